"""Keras' ``RandomFlip``: the identity in predict and in the exports (ringtrain predicts what
Keras predicts from the same ``.keras``); in training each image is flipped or not with Keras'
draw (about half of them, both axes at once for "horizontal_and_vertical"), anew each step and
the same for any split over workers; the model trains (the gradient through it: the op's
gradcheck in test_engine_ops). The other augmentation layers are refused by name.

Imports TensorFlow (slow): one module holds these comparisons.
"""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import model as M
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.ops.augment import RandomFlip
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _flip(mode, x, step=3, example0=0):
    op = RandomFlip(x.shape[1:], mode, 1)
    bufs = op.buffers(len(x), True, need_dx=False)
    ws = {k: np.zeros(s, np.float32 if t == "f" else np.bool_) for k, (s, t) in bufs.items()}
    ws["ctx"] = {"seed": 7, "step": step, "example0": example0}
    return op.forward(ws, x).copy(), ws["flips"].copy()


@pytest.mark.parametrize(
    "mode, axes", [("horizontal", (1,)), ("vertical", (0,)), ("horizontal_and_vertical", (0, 1))]
)
def test_flips_half_the_images_along_keras_axes(mode, axes, rng):
    x = rng.random((400, 3, 4, 2)).astype(np.float32)
    out, flips = _flip(mode, x)
    assert 0.42 < flips.mean() < 0.58
    np.testing.assert_array_equal(out[~flips], x[~flips])
    np.testing.assert_array_equal(out[flips], np.flip(x[flips], [a + 1 for a in axes]))
    _, again = _flip(mode, x, step=4)
    assert (again != flips).mean() > 0.3
    halves = np.concatenate([_flip(mode, x[:150])[0], _flip(mode, x[150:], example0=150)[0]])
    np.testing.assert_array_equal(halves, out)


def _trainer(km, x, y, tmp_path):
    km.save(tmp_path / "m.keras")
    np.savez(tmp_path / "d.npz", x_train=x[:48], y_train=y[:48], x_test=x[48:], y_test=y[48:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", "4", "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.1"]
    args += ["--ipu-host-threads", "1", "--json", "--checkpoint-dir", str(tmp_path / "ck")]
    return Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())


def test_flip_model_predicts_like_keras_trains_and_exports_the_identity(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 1)),
            L.Conv2D(2, 1),
            L.RandomFlip("horizontal"),
            L.Conv2D(3, 3, activation="relu"),
            L.Flatten(),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.random((64, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    t = _trainer(km, x, y, tmp_path)
    try:
        ev = M.Program(t.spec, 16, False, state=t.ipu.state)
        ev.x[:] = x[48:]
        logits = ev.forward(t.spec.views(t.params)).copy()
        mine = np.exp(logits - logits.max(1, keepdims=True))
        want = km.predict(x[48:], verbose=0)
        np.testing.assert_allclose(mine / mine.sum(1, keepdims=True), want, atol=2e-5)
        before = t.params.copy()
        losses = [t.train_one_step()[0] for _ in range(4)]
        assert np.all(np.isfinite(losses)) and not np.array_equal(t.params, before)
        ev.x[:] = x[48:]
        logits = ev.forward(t.spec.views(t.params)).copy()
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    want = np.exp(logits - logits.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert back.layers[1].get_config()["mode"] == "horizontal"
    np.testing.assert_allclose(back.predict(x[48:], verbose=0), want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[48:]})[0], want, atol=2e-5)


@pytest.mark.parametrize(
    "layer", [L.RandomRotation(0.1), L.RandomZoom(0.1), L.RandomContrast(0.2), L.RandomCrop(4, 4)]
)
def test_other_augmentation_layers_are_refused_by_name(layer):
    config = json.loads(keras.Sequential([L.Input((6, 6, 1)), layer, L.Flatten()]).to_json())
    with pytest.raises(InvalidSpec, match=type(layer).__name__):
        parse(config, compiled=False)
