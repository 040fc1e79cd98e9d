"""Keras' ``RandomFlip`` and ``RandomRotation``: the identity in predict and in the exports
(ringtrain predicts what Keras predicts from the same ``.keras``); in training each image is
flipped or not with Keras' draw (about half of them, both axes at once for
"horizontal_and_vertical"), anew each step and the same for any split over workers; the model
trains (the gradient through it: the op's gradcheck in test_engine_ops). Each rotated image is
Keras' ``ops.image.affine_transform`` of the input with the rotation Keras builds from the drawn
angle, for every fill mode and interpolation; the angles spread over ``factor`` × 360°. The
other augmentation layers are refused by name.

Imports TensorFlow (slow): one module holds these comparisons.
"""

import io
import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort
from support.keras_steps import logits, softmax

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.ops.augment import RandomAffine, RandomFlip
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
        z = logits(t, x[48:])
        np.testing.assert_allclose(softmax(z), km.predict(x[48:], verbose=0), atol=2e-5)
        before = t.params.copy()
        losses = [t.train_one_step()[0] for _ in range(4)]
        assert np.all(np.isfinite(losses)) and not np.array_equal(t.params, before)
        want = softmax(logits(t, x[48:]))
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert back.layers[1].get_config()["mode"] == "horizontal"
    np.testing.assert_allclose(back.predict(x[48:], verbose=0), want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[48:]})[0], want, atol=2e-5)


@pytest.mark.parametrize(
    "layer",
    [L.RandomCrop(4, 4)],  # RandomContrast, RandomBrightness: test_keras_augment_pixel
)
def test_other_augmentation_layers_are_refused_by_name(layer):
    config = json.loads(keras.Sequential([L.Input((6, 6, 1)), layer, L.Flatten()]).to_json())
    with pytest.raises(InvalidSpec, match=type(layer).__name__):
        parse(config, compiled=False)


def _affine(x, kind, factors, fill_mode="reflect", interpolation="bilinear", step=1, example0=0):
    op = RandomAffine(x.shape[1:], kind, factors, fill_mode, interpolation, 0.3, 1)
    bufs = op.buffers(len(x), True, need_dx=False)
    ws = {k: np.zeros(s, np.float32) for k, (s, _) in bufs.items()}
    ws["ctx"] = {"seed": 3, "step": step, "example0": example0}
    return op.forward(ws, x).copy(), ws["matrix"].copy()


def _rotate(x, factor, *args, **kw):
    out, m = _affine(x, "rotation", [factor], *args, **kw)
    return out, np.degrees(np.arctan2(m[:, 3], m[:, 0]))


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
@pytest.mark.parametrize("fill_mode", ["reflect", "wrap", "constant", "nearest"])
def test_rotation_is_keras_affine_transform_of_the_drawn_angle(fill_mode, interpolation, rng):
    x = rng.random((6, 7, 5, 2)).astype(np.float32)
    out, degrees = _rotate(x, (-0.4, 0.4), fill_mode, interpolation)
    t = degrees.astype(np.float32) * np.float32(math.pi / 180)
    cx, cy, c, s = 0.5 * (5 - 1), 0.5 * (7 - 1), np.cos(t), np.sin(t)
    matrix = np.stack([c, -s, cx - cx * c + cy * s, s, c, cy - cx * s - cy * c, 0 * c, 0 * c], 1)
    want = keras.ops.image.affine_transform(x, matrix, interpolation, fill_mode, 0.3)
    np.testing.assert_allclose(out, np.asarray(want), atol=2e-6)


@pytest.mark.parametrize("fill_mode", ["reflect", "constant"])
def test_translation_is_keras_affine_transform_of_the_drawn_shifts(fill_mode, rng):
    x = rng.random((200, 7, 5, 2)).astype(np.float32)
    out, m = _affine(x, "translation", [(-0.2, 0.3), (-0.4, 0.1)], fill_mode)
    want = keras.ops.image.affine_transform(x, m, "bilinear", fill_mode, 0.3)
    np.testing.assert_allclose(out, np.asarray(want), atol=2e-6)
    dy, dx = -m[:, 5] / 7, -m[:, 2] / 5
    assert -0.2 <= dy.min() < -0.15 and 0.25 < dy.max() <= 0.3
    assert -0.4 <= dx.min() < -0.35 and 0.05 < dx.max() <= 0.1
    assert np.all(m[:, [0, 4]] == 1) and np.all(m[:, [1, 3, 6, 7]] == 0)


def test_rotation_angles_spread_over_the_factor_anew_each_step_for_any_split(rng):
    x = rng.random((300, 4, 4, 1)).astype(np.float32)
    out, degrees = _rotate(x, (-0.1, 0.2), "reflect", "bilinear")
    assert -36 <= degrees.min() < -30 and 60 < degrees.max() <= 72
    assert abs(degrees.mean() - 18) < 3
    assert not np.array_equal(_rotate(x, (-0.1, 0.2), "reflect", "bilinear", step=2)[1], degrees)
    halves = [_rotate(x[:100], (-0.1, 0.2), "reflect", "bilinear")[0]]
    halves.append(_rotate(x[100:], (-0.1, 0.2), "reflect", "bilinear", example0=100)[0])
    np.testing.assert_array_equal(np.concatenate(halves), out)


def test_image_from_scratch_augmentation_predicts_like_keras_and_trains(tmp_path, rng):
    """keras.io "Image classification from scratch": a nested Sequential of RandomFlip and
    RandomRotation in front of the network."""
    aug = keras.Sequential(
        [
            L.RandomFlip("horizontal"),
            L.RandomRotation(0.1),
            L.RandomTranslation(0.1, 0.2),
            L.RandomZoom(0.2),
        ]
    )
    inp = keras.Input((6, 6, 1))
    x = L.Rescaling(1.0 / 255)(aug(inp))
    x = L.Conv2D(3, 3, activation="relu")(x)
    out = L.Dense(3, activation="softmax")(L.Flatten()(x))
    km = keras.Model(inp, out)
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = (rng.random((64, 6, 6, 1)) * 255).astype(np.float32)
    y = rng.integers(0, 3, 64)
    t = _trainer(km, x, y, tmp_path)
    try:
        z = logits(t, x[48:])
        np.testing.assert_allclose(softmax(z), km.predict(x[48:], verbose=0), atol=2e-5)
        assert not np.allclose(logits(t, x[48:], training=True), z, atol=1e-4)
        before = t.params.copy()
        losses = [t.train_one_step()[0] for _ in range(4)]
        assert np.all(np.isfinite(losses)) and not np.array_equal(t.params, before)
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        sess.run(None, {"input": x[48:]})[0], back.predict(x[48:], verbose=0), atol=2e-5
    )


@pytest.mark.parametrize("factors", [[(-0.3, 0.2)], [(-0.3, 0.2), (0.1, 0.4)]])
def test_zoom_is_keras_affine_transform_of_the_drawn_zooms(factors, rng):
    x = rng.random((200, 7, 5, 2)).astype(np.float32)
    out, m = _affine(x, "zoom", factors, "reflect")
    want = keras.ops.image.affine_transform(x, m, "bilinear", "reflect", 0.3)
    np.testing.assert_allclose(out, np.asarray(want), atol=2e-6)
    zy, zx = m[:, 4] - 1, m[:, 0] - 1
    assert -0.3 <= zy.min() < -0.25 and 0.15 < zy.max() <= 0.2
    np.testing.assert_allclose(m[:, 2], 2 * (1 - m[:, 0]), rtol=1e-6)
    if len(factors) == 1:
        np.testing.assert_array_equal(zx, zy)
    else:
        assert 0.1 <= zx.min() < 0.15 and 0.35 < zx.max() <= 0.4
