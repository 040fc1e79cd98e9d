"""The model's compile settings run, the flags override them only when given, and every record
(start-up line, /status, checkpoint, export) names what ran; built-in models are unchanged."""

import copy
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from ringtrain.errors import CheckpointError, InvalidSpec
from ringtrain_trainer import optim, worker, worker_main
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.keras import config as keras_config
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.optim.registry import BASE
from ringtrain_trainer.telemetry.metrics import TrainerMetrics

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword"),
    # the export carries the optimizer's config, not its state (a known limit, README)
    pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer"),
]


def sgd_nesterov_exponential() -> dict:
    """compile_config.optimizer as Keras 3 writes SGD(ExponentialDecay, nesterov) into .keras."""
    schedule = {
        "module": "keras.optimizers.schedules",
        "class_name": "ExponentialDecay",
        "config": {
            "initial_learning_rate": 0.05,
            "decay_steps": 3,
            "decay_rate": 0.5,
            "staircase": True,
            "name": "ExponentialDecay",
        },
        "registered_name": None,
    }
    config = {**BASE, "name": "SGD", "learning_rate": schedule, "momentum": 0.9, "nesterov": True}
    return {"module": "keras.optimizers", "class_name": "SGD", "config": config}


def test_built_in_models_keep_adam_at_1e_3_bit_for_bit(rng):
    spec = optim.for_run(TrainerConfig(), keras_load.build("cnn"))
    assert (spec.class_name, spec.config["learning_rate"], spec.source) == ("Adam", 1e-3, "default")
    p_new = rng.normal(size=300).astype(np.float32)
    p_old = p_new.copy()
    new = optim.build_spec(spec, p_new)
    old = optim.build("adam", p_old, optim.StepDecay(1e-3))
    g = np.zeros(300, np.float32)
    for _ in range(5):
        g[:] = rng.normal(size=300)
        for o in (new, old):
            o.begin_step(0)
            o.apply(g, 100, 300)
            o.apply(g, 0, 100)
    np.testing.assert_array_equal(p_new, p_old)
    legacy = optim.for_run(TrainerConfig(optimizer="momentum", lr=0.1), keras_load.build("cnn2"))
    assert legacy.name == "momentum" and legacy.config["momentum"] == 0.9


def test_flags_override_only_what_they_name():
    compiled = optim.from_compile_config({"optimizer": sgd_nesterov_exponential()})
    assert optim.resolve(compiled) is compiled
    lr = optim.resolve(compiled, lr=0.2)
    assert lr.config["learning_rate"] == 0.2 and lr.config["nesterov"] is True
    assert "--lr 0.2 replaces the model's learning_rate" in lr.describe()
    adam = optim.resolve(compiled, optimizer="adam")
    assert adam.class_name == "Adam" and adam.source == "--optimizer"
    assert "replaces the model's SGD(" in adam.describe()
    with pytest.raises(InvalidSpec, match=r"--lr-decay: .*is a schedule .*ExponentialDecay"):
        optim.resolve(compiled, lr_decay=0.5)
    decayed = optim.resolve(compiled, lr=0.1, lr_decay=0.5, lr_decay_epochs=2)
    assert decayed.step_decay == (0.5, 2)


def test_tf_keras_2_optimizer_configs_are_read():
    """tf.keras 2.11+'s ``to_json``/``training_config``: extra neutral arguments, a string."""
    doc = {
        "class_name": "Adam",
        "config": {"name": "Adam", "learning_rate": 0.01, "decay": 0.0, "beta_1": 0.8,
                   "jit_compile": True, "is_legacy_optimizer": False},
    }  # fmt: skip
    spec = optim.from_compile_config({"optimizer": doc})
    assert spec.config["beta_1"] == 0.8 and "decay" not in spec.config
    doc["config"]["decay"] = 1e-4  # tf.keras 2's time decay: not implemented
    with pytest.raises(InvalidSpec, match=r"compile_config\.optimizer\.config\.decay=0\.0001"):
        optim.from_compile_config({"optimizer": doc})
    assert optim.from_compile_config({"optimizer": "rmsprop"}).class_name == "RMSprop"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            lambda c: c["optimizer"]["config"].update(loss_scale_factor=2.0),
            "optimizer.config.loss_scale_factor",
        ),
        (lambda c: c.update(loss_weights=[2.0]), "compile_config.loss_weights"),
        (lambda c: c.update(metrics=["mse"]), "compile_config.metrics"),
        (lambda c: c["loss"]["config"].update(reduction="sum"), "loss.config.reduction"),
        (lambda c: c.update(gradient_tape=True), "compile_config.gradient_tape"),
    ],
)
def test_the_model_config_refuses_unsupported_compile_settings(change, field):
    cfg = copy.deepcopy(keras_model.preset_config("cnn"))
    change(cfg["compile_config"])
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        keras_config.parse(cfg)


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    """A small .keras model compiled with SGD(nesterov) and an ExponentialDecay schedule."""
    import keras

    S = keras.optimizers.schedules
    m = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    m.compile(
        optimizer=keras.optimizers.SGD(
            S.ExponentialDecay(0.05, 3, 0.5, staircase=True), momentum=0.9, nesterov=True
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    path = tmp_path_factory.mktemp("model") / "sgd.keras"
    m.save(path)
    return path


def test_worker_trains_a_keras_model_with_its_compile_optimizer(
    keras_file, tmp_path, capsys, mnist5k
):
    import keras

    ck = tmp_path / "ck"
    argv = ["--model", str(keras_file), "--dataset", "mnist-5k", "--json"]
    argv += ["--checkpoint-dir", str(ck), "--termination-log", "", "--export", "out.keras"]
    assert worker_main.main([*argv, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "optimizer" in ln)
    assert "optimizer SGD(learning_rate=ExponentialDecay(initial_learning_rate=0.05" in line
    assert "momentum=0.9" in line and "nesterov=True" in line
    assert "[model compile_config]" in line and "from_logits=True" in line
    manifest = json.loads((ck / "ckpt-0000000004.json").read_text())
    assert manifest["optimizer"] == "sgd" and manifest["optimizer_iterations"] == 4
    recorded = manifest["optimizer_config"]["keras"]
    assert recorded["class_name"] == "SGD" and recorded["config"]["nesterov"] is True
    exported = keras.saving.load_model(ck / "out.keras")
    assert isinstance(exported.optimizer, keras.optimizers.SGD) and exported.optimizer.nesterov
    lr = exported.optimizer._learning_rate
    assert isinstance(lr, keras.optimizers.schedules.ExponentialDecay) and lr.staircase
    back = worker.Trainer(  # the export given back as --model runs the same optimizer
        TrainerConfig(model=str(ck / "out.keras"), dataset="mnist-5k", steps=1),
        LocalCollective(),
        mnist5k,
    )
    back.close()
    assert back.optimizer_spec.keras == manifest["optimizer_config"]["keras"]

    # resumed: same optimizer, state and iterations (step 4 runs at 0.05 * 0.5 ** (4 // 3))
    assert worker_main.main([*argv, "--steps", "5"]) == 0
    manifest = json.loads((ck / "ckpt-0000000005.json").read_text())
    assert manifest["optimizer_iterations"] == 5
    # a new --lr may continue it, and says so
    assert worker_main.main([*argv, "--steps", "6", "--lr", "0.01"]) == 0
    said = capsys.readouterr().err
    assert "resuming a checkpoint trained with optimizer SGD(learning_rate=Exponential" in said
    assert "this run: SGD(learning_rate=0.01" in said
    # another optimizer cannot continue this checkpoint's state
    with pytest.raises(CheckpointError, match=r"checkpoint used optimizer SGD\(.*this run Adam"):
        t = worker.Trainer(
            TrainerConfig(
                model=str(keras_file),
                dataset="mnist-5k",
                steps=7,
                optimizer="adam",
                checkpoint_dir=str(ck),
            ),
            LocalCollective(),
        )
        try:
            t.run()
        finally:
            t.close()


def test_status_and_tensorboard_rate_follow_the_schedule(keras_file, mnist5k):
    metrics = TrainerMetrics()
    t = worker.Trainer(
        TrainerConfig(model=str(keras_file), dataset="mnist-5k", steps=4, batch_size=16),
        LocalCollective(),
        mnist5k,
        metrics=metrics,
    )
    try:
        t.run()
    finally:
        t.close()
    status = metrics.status()["optimizer"]
    assert status["keras"]["class_name"] == "SGD" and status["source"] == "model compile_config"
    assert t.optimizer.iterations == 4
    assert t.optimizer.lr == pytest.approx(0.05 * 0.5)  # step 4 ran at iteration 3: 0.05 * 0.5


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_is_the_same_whatever_the_buckets_cut(clip, mnist5k):
    """Per-tensor and global norms wait for their whole tensor / gradient, so buckets that cut
    the Dense kernel in pieces, with or without overlap, train to the same bits as one bucket."""
    cfg = copy.deepcopy(keras_model.preset_config("cnn"))
    cfg["config"]["name"] = "mine"  # not the preset: its compile settings run
    plain = json.dumps(cfg)
    cfg["compile_config"]["optimizer"]["config"][clip] = 0.05
    clipped = json.dumps(cfg)
    runs = []
    for model, bucket_mb, overlap in [
        (clipped, 25.0, True),
        (clipped, 0.001, True),
        (clipped, 0.001, False),
        (plain, 25.0, True),
    ]:
        t = worker.Trainer(
            TrainerConfig(
                model=model,
                dataset="mnist-5k",
                steps=3,
                batch_size=16,
                bucket_mb=bucket_mb,
                overlap_comm=overlap,
            ),
            LocalCollective(),
            mnist5k,
        )
        try:
            t.run()
        finally:
            t.close()
        runs.append(t.params.copy())
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])
    assert not np.array_equal(runs[0], runs[3])  # the clipping did bind


def test_two_workers_clip_the_reduced_gradient_like_one_worker_with_their_batch(mnist5k):
    """Clipping acts on the reduced (averaged) gradient: 2 workers x batch 8 with tiny buckets
    train like 1 worker x batch 16 (SGD nesterov, ExponentialDecay, global_clipnorm)."""
    from test_trainer_reducer import run_ranks

    cfg = copy.deepcopy(keras_model.preset_config("cnn"))
    cfg["config"]["name"] = "mine"
    cfg["compile_config"]["optimizer"] = sgd_nesterov_exponential()
    cfg["compile_config"]["optimizer"]["config"]["global_clipnorm"] = 0.05
    model = json.dumps(cfg)

    def train(batch, col, bucket_mb=25.0):
        t = worker.Trainer(
            TrainerConfig(
                model=model, dataset="mnist-5k", steps=4, batch_size=batch, bucket_mb=bucket_mb
            ),
            col,
            mnist5k,
        )
        try:
            t.run()
        finally:
            t.close()
        return t.params.copy()

    single = train(16, LocalCollective())
    res, _ = run_ranks(2, lambda rank, col: train(8, col, bucket_mb=0.001))
    for params in res:
        np.testing.assert_allclose(params, single, rtol=1e-4, atol=1e-6)
