"""Keras' ``RandomBrightness`` and ``RandomContrast`` (``engine/ops/augment_pixel.py``): the
op's input gradient against finite differences; its per-image draws against the ones real
Keras makes (the factor each image was changed by, recovered from the output, spans the same
interval with the same mean); a model built by Keras predicts like Keras (the identity), trains
(the layer active), and exports the identity (``.keras`` reloaded by Keras, ONNX by
onnxruntime)."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest
from support.keras_steps import logits, softmax, train_beside_keras
from support.opcheck import check_gradients

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain_trainer.engine.ops.augment_pixel import RandomPixel
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.entry import Args
from ringtrain_trainer.keras.layers_augment_pixel import _parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


@pytest.mark.parametrize("kind, bounds", [("brightness", (-0.2, 0.3)), ("contrast", (0.5, 1.4))])
def test_pixel_augmentation_gradients(kind, bounds, rng):
    check_gradients(RandomPixel((3, 4, 2), kind, bounds, (-1.5, 1.5), 2), rng)


def _ours(kind, bounds, x, value_range):
    op = RandomPixel(x.shape[1:], kind, bounds, value_range, 1)
    bufs = op.buffers(len(x), True, need_dx=False)
    ws = {k: np.zeros(s, np.float32 if t == "f" else np.bool_) for k, (s, t) in bufs.items()}
    ws["ctx"] = {"seed": 7, "step": 3, "example0": 0}
    return op.forward(ws, x).copy()


def _implied(kind, x, out):
    """The factor each image was changed by (no value is clipped in these inputs)."""
    if kind == "brightness":
        return (out - x).mean(axis=(1, 2, 3)) / 255.0
    mean = x.mean(axis=(1, 2), keepdims=True)
    return ((out - mean) / (x - mean)).mean(axis=(1, 2, 3))


@pytest.mark.parametrize(
    "layer, kind, bounds",
    [
        (L.RandomBrightness((-0.2, 0.3)), "brightness", (-0.2, 0.3)),
        (L.RandomContrast(0.4), "contrast", (1.0, 1.4)),  # Keras 3: a number f is [1, 1 + f]
        (L.RandomContrast((0.3, 0.2)), "contrast", (0.8, 1.3)),  # sorted, as Keras
    ],
)
def test_draws_follow_keras(layer, kind, bounds, rng):
    x = rng.uniform(100, 150, (400, 4, 4, 2)).astype(np.float32)
    theirs = _implied(kind, x, keras.ops.convert_to_numpy(layer(x, training=True)))
    args = _parse(Args({"class_name": type(layer).__name__, "config": layer.get_config()}, 0))
    lo, hi = bounds
    if kind == "contrast":
        assert (1 - args["factor"][0], 1 + args["factor"][1]) == pytest.approx(bounds)
    else:
        assert args["factor"] == pytest.approx(bounds)
    ours = _implied(kind, x, _ours(kind, bounds, x, args["value_range"]))
    width = hi - lo
    for f in (ours, theirs):
        assert lo - 1e-3 <= f.min() < lo + 0.05 * width and hi - 0.05 * width < f.max() <= hi + 1e-3
        assert abs(f.mean() - (lo + hi) / 2) < 0.05 * width
    assert np.allclose(keras.ops.convert_to_numpy(layer(x, training=False)), x)


@pytest.mark.parametrize(
    "layer",
    [L.RandomBrightness(0.2, value_range=(0, 1)), L.RandomContrast(0.3, value_range=(0, 1))],
)
def test_pixel_model_predicts_like_keras_trains_and_exports_the_identity(layer, tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            layer,
            L.Conv2D(3, 3, activation="relu"),
            L.Flatten(),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.random((40, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    want0 = km.predict(x[32:], verbose=0)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 3, 8, n_train=32)
    try:
        trained = logits(t, x[:8], training=True)
        assert not np.allclose(trained, logits(t, x[:8]), atol=1e-4)  # the layer is active
        z = logits(t, x[32:])
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    assert np.all(np.isfinite(ours)) and abs(ours[0] - theirs[0]) < 0.2  # same start, own draws
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert type(back.layers[0]).__name__ == type(layer).__name__
    want = back.predict(x[32:], verbose=0)
    np.testing.assert_allclose(softmax(z), want, atol=2e-5)
    assert not np.allclose(want, want0, atol=1e-5)  # trained
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[32:]})[0], want, atol=2e-5)
