"""Everyday Keras layers a user trial found refused (issue 19, trial3): Identity,
UnitNormalization, GroupNormalization, Dot and CategoryEncoding. Each new op against finite
differences (``support.opcheck``), a small model built by real Keras trained by ringtrain and
by Keras from the same ``.keras`` weights on the same batches (loss per step, weights after),
the ``.keras`` export reloaded by Keras and the ONNX export run by onnxruntime.

Imports TensorFlow (slow): one module holds these comparisons."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import train_beside_keras
from support.opcheck import check_gradients, forward

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.groupnorm import GroupNorm
from ringtrain_trainer.engine.ops.unitnorm import UnitNorm
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _beside(km, x, y, tmp_path, steps=4, batch=8, n=32, rtol=1e-4, onnx=True):
    """Train ``km`` (compiled) beside ringtrain; compare losses, weights, and both exports'
    predictions with Keras' own. Returns the reloaded Keras model."""
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, steps, batch, n_train=n)
    try:
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    np.testing.assert_allclose(ours, theirs, rtol=rtol)
    for a, b in zip(weights, km.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-5)
    xt = {k: v[n:] for k, v in x.items()} if isinstance(x, dict) else x[n:]
    want = km.predict(xt, verbose=0)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    np.testing.assert_allclose(back.predict(xt, verbose=0), want, atol=2e-5)
    if onnx:
        write_onnx(tmp_path / "m.onnx", config, weights)
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        feed = dict(xt) if isinstance(xt, dict) else {sess.get_inputs()[0].name: xt}
        np.testing.assert_allclose(sess.run(None, feed)[0], want, atol=2e-5)
    return back


def test_identity_builds_to_nothing_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential([L.Input((4,)), L.Identity(), L.Dense(1)])
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = x.sum(1, keepdims=True).astype(np.float32)
    back = _beside(km, x, y, tmp_path)
    assert type(back.layers[0]).__name__ == "Identity"
    import onnx

    assert "Identity" in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}


@pytest.mark.parametrize("shape", [(5,), (3, 4)])
def test_unit_norm_gradients(shape, rng):
    check_gradients(UnitNorm(shape), rng)


def test_unit_norm_is_keras_formula_also_on_a_zero_vector(rng):
    x = rng.normal(size=(3, 2, 4)).astype(np.float32)
    x[1, 0] = 0.0
    want = np.asarray(L.UnitNormalization()(x))
    np.testing.assert_allclose(forward(UnitNorm((2, 4)), x, {}, np.float32), want, atol=1e-6)
    assert np.all(want[1, 0] == 0)


def test_unit_normalization_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential([L.Input((8,)), L.Dense(4), L.UnitNormalization(), L.Dense(1)])
    km.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x = rng.normal(size=(40, 8)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    _beside(km, x, y, tmp_path)


def _config(*layers) -> dict:
    import json

    return json.loads(keras.Sequential([*layers]).to_json())


def test_unit_normalization_off_the_last_axis_is_refused_by_name():
    with pytest.raises(InvalidSpec, match=r"UnitNormalization.*axis=\[1, 2\]"):
        parse(_config(L.Input((3, 4)), L.UnitNormalization(axis=[1, 2])), compiled=False)


@pytest.mark.parametrize(
    "op",
    [GroupNorm((3, 3, 4), 2), GroupNorm((5, 6), 3, 1e-3, False, True), GroupNorm((4,), 4)],
    ids=["2d-2groups", "1d-scale-only", "one-per-channel"],
)
def test_group_norm_gradients(op, rng):
    check_gradients(op, rng)


@pytest.mark.parametrize("groups, center", [(4, True), (-1, False), (1, True)])
def test_group_normalization_trains_like_keras_and_exports(groups, center, tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            L.Conv2D(8, 3),
            L.GroupNormalization(groups=groups, center=center, epsilon=1e-2),
            L.Activation("relu"),
            L.GlobalAveragePooling2D(),
            L.Dense(1),
        ]
    )
    # SGD: with one channel per group the conv's bias has no gradient but rounding, which
    # Adam would blow up into full steps
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(size=(40, 6, 6, 2)).astype(np.float32)
    y = x.mean((1, 2, 3))[:, None].astype(np.float32)
    _beside(km, x, y, tmp_path)


def test_group_normalization_refusals_name_the_argument():
    with pytest.raises(InvalidSpec, match=r"GroupNormalization.*axis=1"):
        parse(_config(L.Input((4, 6)), L.GroupNormalization(2, axis=1)), compiled=False)
