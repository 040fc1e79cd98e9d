"""A two-input two-output Keras model on 2 real worker processes over the ring: the test loss
of every output after every step follows Keras trained on the same global batches from the same
``.keras`` file; 2 workers × B end where 1 worker × 2B ends; the chief's log, final line and
export name every output; the Evaluator reports every output's loss and metric."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support import procs as procs_mod
from support.ports import loopback_addresses
from support.reference import single_worker_run
from test_keras_multi_io import two_in_two_out

from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.engine import model as model_mod
from ringtrain_trainer.evaluator import Evaluator

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
WORKERS, BATCH, STEPS, SEED, N = 2, 8, 6, 3, 64
#: as the zoo's: float32 numpy against TensorFlow's kernels, a fraction of each test loss
CURVE_RTOL = 1e-4
NXB_ATOL = 1e-5


def _files(tmp_path):
    km = two_in_two_out()
    km.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    km.save(tmp_path / "m.keras")
    rng = np.random.default_rng(11)
    d = {
        "tab": rng.random((N, 6)).astype(np.float32),
        "img": rng.random((N, 4, 4, 1)).astype(np.float32),
        "cls": rng.integers(0, 3, N),
        "reg": rng.normal(size=(N, 2)).astype(np.float32),
    }
    arrays = {}
    for k, v in d.items():
        kind = "x" if k in ("tab", "img") else "y"
        arrays[f"{kind}_train_{k}"], arrays[f"{kind}_test_{k}"] = v[:48], v[48:]
    np.savez(tmp_path / "d.npz", **arrays)
    return str(tmp_path / "m.keras"), str(tmp_path / "d.npz"), d


def _argv(model, data, ck, batch):
    return [
        "--model", model, "--data", data, "--steps", str(STEPS), "--batch-size", str(batch),
        "--seed", str(SEED), "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
        "--checkpoint-keep", "100", "--ipu-host-threads", "1",
    ]  # fmt: skip


def _keras_curves(model, d):
    km = keras.saving.load_model(model)
    sharder = data_mod.Sharder(48, BATCH * WORKERS, 1, 0, SEED)
    pos, curves = data_mod.Position(0, 0, sharder.global_batch), []
    x_test = {k: d[k][48:] for k in ("tab", "img")}
    y_test = {k: d[k][48:] for k in ("cls", "reg")}
    for _ in range(STEPS):
        idx = sharder.global_batch_indices(pos.epoch, pos.batch)
        km.train_on_batch({k: d[k][idx] for k in ("tab", "img")},
                          {k: d[k][idx] for k in ("cls", "reg")})  # fmt: skip
        logs = km.evaluate(x_test, y_test, batch_size=16, verbose=0, return_dict=True)
        curves.append([logs["loss"], logs["cls_loss"], logs["reg_loss"]])
        pos = sharder.advance(pos)
    return np.array(curves), km


@pytest.mark.slow  # 2 worker processes and TensorFlow: 45-65 s on the shared 2 cores
@pytest.mark.timeout(300)
def test_two_workers_train_a_two_input_two_output_model_like_keras(tmp_path):
    model, data, d = _files(tmp_path)
    addresses, token = loopback_addresses(WORKERS), procs_mod.new_token()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    argv = [*_argv(model, data, tmp_path / "ck", BATCH), "--export", "model.keras", "--json"]
    procs = [
        procs_mod.start_member(
            [*procs_mod.WORKER, *argv, "--termination-log", str(tmp_path / f"log-{r}")],
            addresses,
            r,
            token,
            env,
        )
        for r in range(WORKERS)
    ]
    try:
        want, _ = _keras_curves(model, d)
    finally:
        outs = [p.communicate(timeout=200) for p in procs]
    assert [p.returncode for p in procs] == [0] * WORKERS, [e[-3000:] for _, e in outs]
    lines = [json.loads(x) for x in outs[0][0].splitlines() if x.startswith("{")]
    progress = [x for x in lines if x.get("event") == "progress"]
    named = {"cls_loss", "reg_loss", "cls_accuracy", "reg_mae"}
    assert progress and set(progress[-1]["outputs"]) == named
    final = json.loads((tmp_path / "log-0").read_text())
    assert set(final["test_outputs"]) == {"cls_loss", "cls_accuracy", "reg_loss", "reg_mae"}

    cfg = TrainerConfig.from_args(
        ["--model", model, "--data", data, "--checkpoint-dir", str(tmp_path / "ck")],
        {"TF_CONFIG": '{"task":{"type":"evaluator"}}'},
    )
    ev = Evaluator(cfg, out=io.StringIO())
    states = [ev.ckpt.load(m) for m in ev.ckpt.manifests()]
    got = []
    for s in states:
        loss, _ = ev.evaluate(s)
        got.append([loss, ev.outputs["cls_loss"], ev.outputs["reg_loss"]])
    np.testing.assert_allclose(np.array(got), want, rtol=CURVE_RTOL)
    assert ev.outputs["cls_accuracy"] == pytest.approx(final["test_outputs"]["cls_accuracy"])

    # the chief's export predicts every output as ringtrain does
    last = states[-1]
    assert set(last.loss_config["outputs"]) == named
    assert set(last.loss_config["keras"]) == {"cls", "reg"}
    prog = model_mod.Program(ev.spec, 16, train=False, state=last.model_state)
    prog.x[:] = np.concatenate([d["tab"][48:], d["img"][48:].reshape(16, -1)], axis=1)
    prog.forward(ev.spec.views(last.params))
    z_cls, z_reg = (prog.tensors[o].astype(np.float64) for o in ev.spec.graph.outputs)
    e = np.exp(z_cls - z_cls.max(1, keepdims=True))
    back = keras.saving.load_model(tmp_path / "ck" / "model.keras")
    b_cls, b_reg = back.predict({"tab": d["tab"][48:], "img": d["img"][48:]}, verbose=0)
    np.testing.assert_allclose(b_cls, e / e.sum(1, keepdims=True), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b_reg, z_reg, rtol=1e-4, atol=1e-5)

    single = single_worker_run(
        TrainerConfig.from_args(_argv(model, data, tmp_path / "one", WORKERS * BATCH), {})
    )
    np.testing.assert_allclose(single.params, last.params, rtol=0, atol=NXB_ATOL)
