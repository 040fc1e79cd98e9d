"""Functional Keras models (a plain chain, a residual block with ``Add``, branches joined by
``Concatenate`` and the other merges) trained by ringtrain and by Keras from the same ``.keras``
starting weights on the same batches: the same loss at every step, the same predictions after,
and exports that Keras and onnxruntime load and that predict what ringtrain predicts.

Imports TensorFlow (slow), so one module holds every such comparison for Functional models.
"""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.fused import ConvPool
from ringtrain_trainer.engine.ops.merge import Concatenate, Merge
from ringtrain_trainer.export import read_keras, write_keras, write_onnx
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 5, 8


def _chain():
    inp = L.Input((8, 8, 1))
    h = L.Conv2D(3, 3, activation="relu")(inp)
    h = L.MaxPooling2D(2)(h)
    h = L.Flatten()(h)
    h = L.Dense(6, activation="relu")(h)
    return keras.Model(inp, L.Dense(4, activation="softmax")(h)), ConvPool


def _resnet():
    inp = L.Input((6, 6, 2))
    c1 = L.Conv2D(4, 3, padding="same", activation="relu")(inp)
    h = L.Conv2D(4, 3, padding="same")(c1)
    h = L.BatchNormalization()(h)
    h = L.Add()([c1, h])  # c1 is read twice: its gradient is a sum
    h = L.ReLU()(h)
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inp, L.Dense(4, activation="softmax")(h)), Merge


def _branches():
    inp = L.Input((4, 4, 1))
    f = L.Flatten()(inp)
    a = L.Dense(6, activation="relu")(f)
    b = L.Dense(5, activation="tanh")(f)
    c = L.Concatenate()([a, b])
    d1 = L.Dense(4)(c)
    d2 = L.Dense(4, activation="sigmoid")(c)
    m = L.Average()([L.Multiply()([d1, d2]), L.Maximum()([d1, d2])])
    s = L.Minimum()([L.Subtract()([m, d2]), d1])
    out = L.Dense(4, activation="softmax")(L.Concatenate()([s, a]))
    return keras.Model(inp, out), Concatenate


MODELS = {"chain": _chain, "resnet": _resnet, "branches": _branches}


@pytest.mark.parametrize("name", list(MODELS))
def test_functional_models_train_like_keras_and_export_what_they_predict(name, tmp_path, rng):
    km, op_kind = MODELS[name]()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    km.save(tmp_path / "m.keras")
    assert json.loads(km.to_json())["class_name"] == "Functional"
    shape = km.input_shape[1:]
    x = rng.random((48, *shape)).astype(np.float32)
    y = rng.integers(0, 4, 48)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--optimizer", "sgd"]
    args += ["--lr", "0.1", "--ipu-host-threads", "1", "--json"]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    try:
        assert any(isinstance(op, op_kind) for op in t.spec.layers)
        for _ in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            assert loss == pytest.approx(float(km.train_on_batch(x[idx], y[idx])), rel=1e-4)
        prog = M.Program(t.spec, 16, False, state=t.ipu.state)
        prog.x[:] = x[32:].reshape(prog.x.shape)
        logits = prog.forward(t.spec.views(t.params)).copy()
        want = km.predict(x[32:], verbose=0)
        mine = np.exp(logits - logits.max(1, keepdims=True))
        np.testing.assert_allclose(mine / mine.sum(1, keepdims=True), want, atol=2e-5)
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    assert config["class_name"] == "Functional"
    path = write_keras(tmp_path / "out.keras", config, weights)
    back = keras.saving.load_model(path).predict(x[32:], verbose=0)
    np.testing.assert_allclose(back, want, atol=2e-5)
    _, got = read_keras(path)
    for a, b in zip(got, weights, strict=True):
        np.testing.assert_array_equal(a, b)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (onnx_out,) = sess.run(None, {"input": x[32:]})
    np.testing.assert_allclose(onnx_out, want, atol=2e-5)


def test_read_keras_reads_a_functional_file_keras_wrote(tmp_path):
    km, _ = _resnet()
    rng = np.random.default_rng(3)
    km.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32) for w in km.get_weights()])
    km.save(tmp_path / "k.keras")
    _, got = read_keras(tmp_path / "k.keras")
    for a, b in zip(got, km.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_hand_ordered_functional_config_exports_in_keras_own_layer_order(tmp_path):
    """Keras lists a Functional model's layers deepest first, ties in depth-first order from
    the output, whatever order a config lists them in; ``get_weights()`` and the ``.keras``
    groups follow that order, so the writer must too or two Dense layers swap weights."""
    i = L.Input((4,), name="img")
    a = L.Dense(3, name="zz_b")(i)
    b = L.Dense(3, name="aa_a")(i)
    km = keras.Model(i, L.Dense(2, name="head")(L.Add(name="sum")([b, a])))
    rng = np.random.default_rng(5)
    km.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in km.get_weights()])
    cfg = json.loads(km.to_json())
    assert [x["name"] for x in cfg["config"]["layers"]] == ["img", "aa_a", "zz_b", "sum", "head"]
    cfg["config"]["layers"] = cfg["config"]["layers"][::-1]  # as a person might write it
    path = write_keras(tmp_path / "m.keras", cfg, km.get_weights())
    x = rng.random((5, 4)).astype(np.float32)
    want = km.predict(x, verbose=0)
    np.testing.assert_allclose(keras.saving.load_model(path).predict(x, verbose=0), want, rtol=1e-5)
    write_onnx(tmp_path / "m.onnx", cfg, km.get_weights())
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], want, rtol=1e-5, atol=1e-6)
