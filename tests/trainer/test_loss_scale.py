"""Loss scaling against its definitions: Keras' LossScaleOptimizer (the real one) for the
dynamic scale, and real worker processes for the agreement — an overflow on one worker only
makes every worker skip the step and halve the scale, and their weights stay identical."""

from __future__ import annotations

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
from support import procs as procs_mod
from support.ports import loopback_addresses

from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.optim.loss_scale import GROWTH_STEPS, INITIAL_SCALE, LossScale
from ringtrain_trainer.optim.numerics import ModelNumerics, for_run


def test_dynamic_scale_follows_keras_loss_scale_optimizer():
    import keras

    growth = 3
    grads = [1.0, 1.0, np.inf, 1.0, 1.0, 1.0, 1.0, np.nan, 1.0, 1.0, 1.0]
    var = keras.Variable(np.zeros(1, np.float32))
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=1.0), initial_scale=8.0, dynamic_growth_steps=growth
    )
    opt.build([var])
    ours, w = LossScale("dynamic", 8.0, growth), np.zeros(1, np.float32)
    for g in grads:
        scale = ours.scale
        opt.apply([keras.ops.convert_to_tensor(np.full(1, g * scale, np.float32))], [var])
        if ours.update(np.isfinite(g)):
            w -= np.float32(g * scale / scale)
        assert ours.scale == float(opt.dynamic_scale.numpy()), g
        assert ours.counter == int(opt.step_counter.numpy())
        np.testing.assert_array_equal(w, var.numpy())
    assert opt.iterations.numpy() == 9  # the two skipped steps are not iterations
    assert ours.skipped == 2


def test_keras_defaults_and_what_the_model_and_the_flags_decide():
    keras_default = __import__("keras").optimizers.LossScaleOptimizer(
        __import__("keras").optimizers.SGD()
    )
    assert (
        keras_default.initial_scale,
        keras_default.dynamic_growth_steps,
    ) == (INITIAL_SCALE, GROWTH_STEPS)
    cfg = TrainerConfig.from_args([], {})

    class Model:
        numerics = ModelNumerics("mixed_float16")

    n = for_run(cfg, Model())
    assert (n.precision, n.loss_scale.mode, n.loss_scale.scale) == ("fp16", "dynamic", 2.0**15)
    Model.numerics = ModelNumerics("mixed_float16", auto_scale_loss=False)
    assert for_run(cfg, Model()).loss_scale.mode == "off"
    Model.numerics = ModelNumerics("mixed_float16", loss_scale=(512.0, 10))
    ls = for_run(cfg, Model()).loss_scale
    assert (ls.scale, ls.growth_steps) == (512.0, 10)
    Model.numerics = None  # a hand-built model (ModelSpec's default): no Keras settings
    assert for_run(cfg, Model()).precision == "fp32"
    assert for_run(cfg, Model()).loss_scale.mode == "off"
    flags = TrainerConfig.from_args(["--precision", "fp16", "--loss-scaling", "static"], {})
    assert for_run(flags, Model()).loss_scale.mode == "static"


def _npz(path, ds: data_mod.Dataset, poison: np.ndarray | None) -> str:
    x = ds.train.images.astype(np.float32) * np.float32(ds.train.scale)
    if poison is not None:
        x[poison] = 1e5  # beyond float16's 65504: inf on this worker's IPU
    xt = ds.test.images.astype(np.float32) * np.float32(ds.test.scale)
    np.savez(path, x_train=x, y_train=ds.train.labels, x_test=xt, y_test=ds.test.labels)
    return str(path)


def test_an_overflow_on_one_worker_is_skipped_by_every_worker(tmp_path, mnist5k):
    b = 16
    first = data_mod.Sharder(len(mnist5k.train), b, 2, 1, seed=0).indices(0, 0)
    files = [
        _npz(tmp_path / "clean.npz", mnist5k, None),
        _npz(tmp_path / "bad.npz", mnist5k, first),
    ]
    addresses, token = loopback_addresses(2), procs_mod.new_token()
    common = [*procs_mod.WORKER, "--steps", "3", "--eval-every", "0", "--json"]
    common += ["--batch-size", str(b), "--precision", "fp16", "--optimizer", "sgd"]
    procs = [
        procs_mod.start_member([*common, "--data", files[r]], addresses, r, token) for r in range(2)
    ]
    finals, logs = [], []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        finals.append(json.loads(out.strip().splitlines()[-1]))
        logs.append([line for line in err.splitlines() if "skipped" in line])
    for lines in logs:
        assert lines == [
            "ringtrain worker: step 1: non-finite reduced gradient: step skipped, "
            "loss scale 32768 -> 16384"
        ]
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]


def test_a_keras_mixed_float16_model_trains_in_fp16_with_its_loss_scale(tmp_path, mnist5k):
    import keras
    from support.reference import single_worker_run

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        m = keras.Sequential(
            [
                keras.Input((28, 28)),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )
        inner = keras.optimizers.SGD(0.05)
        m.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(inner, 1024.0, 7),
            loss="sparse_categorical_crossentropy",
        )
        path = tmp_path / "m.json"
        path.write_text(m.to_json())
        m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", auto_scale_loss=False)
        doc = json.loads(m.to_json())
        # this Keras does not serialize auto_scale_loss; a config that carries it is honoured
        doc["compile_config"]["auto_scale_loss"] = False
        off = tmp_path / "off.json"
        off.write_text(json.dumps(doc))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    cfg = TrainerConfig.from_args(["--model", str(path), "--steps", "3", "--eval-every", "0"], {})
    t = single_worker_run(cfg, mnist5k)
    assert t.numerics.precision == "fp16" and t.ipu.precision.half
    assert (t.loss_scale.mode, t.loss_scale.scale, t.loss_scale.growth_steps) == (
        "dynamic",
        1024.0,
        7,
    )
    assert t.optimizer_spec.describe().startswith("SGD(learning_rate=0.05")
    assert t.exe.plan.weights == t.spec.num_params * 2
    cfg = TrainerConfig.from_args(["--model", str(off), "--steps", "1", "--eval-every", "0"], {})
    assert single_worker_run(cfg, mnist5k).loss_scale.mode == "off"


def test_the_dynamic_scale_is_checkpointed_and_resumed(tmp_path, mnist5k):
    from support.reference import single_worker_run

    argv = ["--precision", "fp16", "--loss-scale-growth-steps", "2", "--eval-every", "0"]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--batch-size", "16"]
    first = single_worker_run(TrainerConfig.from_args([*argv, "--steps", "2"], {}), mnist5k)
    assert (first.loss_scale.scale, first.loss_scale.counter) == (65536.0, 0)
    again = single_worker_run(TrainerConfig.from_args([*argv, "--steps", "3"], {}), mnist5k)
    assert again.step == 3
    assert (again.loss_scale.scale, again.loss_scale.counter) == (65536.0, 1)
