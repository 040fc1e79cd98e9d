"""Keras ``Resizing`` (``engine/ops/resize.py``): the op's input gradient against finite
differences for up- and downsampling in both interpolations; models built by real Keras with
``Resizing`` after the input and between convolutions trained by ringtrain and by Keras from the
same ``.keras`` weights on the same batches (predictions, loss at every step, weights after);
the export reloaded by Keras and run by onnxruntime (``Resize``, half-pixel coordinates); the
options ringtrain does not implement refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from support.keras_steps import follows_keras, logits, softmax, train_beside_keras
from support.opcheck import check_gradients

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.resize import Resize
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("hw", [(3, 5), (7, 4), (6, 6)], ids=["down", "mixed", "up"])
def test_resize_gradients(mode, hw, rng):
    check_gradients(Resize((5, 4, 2), *hw, mode), rng)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("hw", [(8, 8), (5, 11), (21, 3)])
def test_resize_matches_keras_ops(mode, hw, rng):
    x = rng.normal(size=(2, 10, 7, 3)).astype(np.float32)
    want = keras.ops.convert_to_numpy(keras.ops.image.resize(x, hw, interpolation=mode))
    op = Resize(x.shape[1:], *hw, mode)
    ws = {k: np.zeros(s, np.float32) for k, (s, _) in op.buffers(2, False, False).items()}
    np.testing.assert_allclose(op.forward(ws, x), want, atol=1e-5)


def _model(mode: str) -> keras.Model:
    x = L.Input((9, 9, 2))
    if mode == "upsampling-bilinear":  # UpSampling2D's bilinear is the same resize (DeepLab's)
        y = L.UpSampling2D(2, interpolation="bilinear")(x)
        y = L.Conv2D(3, 3, strides=2, activation="relu")(y)
        y = L.UpSampling2D((1, 2), interpolation="bilinear")(y)
        return keras.Model(x, L.Dense(3, activation="softmax")(L.Flatten()(y)))
    y = L.Resizing(6, 6, interpolation=mode)(x)
    y = L.Conv2D(3, 3, activation="relu")(y)
    y = L.Resizing(7, 5, interpolation=mode)(y)  # inside the graph: its backward feeds Conv2D
    y = L.Flatten()(y)
    return keras.Model(x, L.Dense(3, activation="softmax")(y))


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "upsampling-bilinear"])
def test_resizing_trains_like_keras_and_exports(mode, tmp_path, rng):
    km = _model(mode)
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(40, 9, 9, 2)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    before = km.predict(x[32:], verbose=0)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 4, 8, n_train=32)
    try:
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
        got = logits(t, x[32:])
    finally:
        t.close()
    assert not np.allclose(before, km.predict(x[32:], verbose=0), atol=1e-4)  # it trained
    follows_keras(ours, theirs, weights, km, rtol=1e-4, atol=1e-5)
    want = km.predict(x[32:], verbose=0)
    np.testing.assert_allclose(softmax(got), want, atol=1e-5)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert back.layers[1].get_config()["interpolation"] == mode.rsplit("-", 1)[-1]
    np.testing.assert_allclose(back.predict(x[32:], verbose=0), want, atol=1e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[32:]})[0], want, atol=1e-5)


@pytest.mark.parametrize(
    "layer, arg",
    [
        (L.Resizing(4, 4, interpolation="bicubic"), "interpolation"),
        (L.Resizing(4, 4, crop_to_aspect_ratio=True), "crop_to_aspect_ratio"),
        (L.Resizing(4, 4, pad_to_aspect_ratio=True), "pad_to_aspect_ratio"),
        (L.Resizing(4, 4, antialias=True), "antialias"),
    ],
)
def test_unsupported_resizing_options_are_refused_by_name(layer, arg):
    config = json.loads(keras.Sequential([L.Input((6, 6, 1)), layer, L.Flatten()]).to_json())
    with pytest.raises(InvalidSpec, match=f"Resizing.*{arg}"):
        parse(config, compiled=False)
