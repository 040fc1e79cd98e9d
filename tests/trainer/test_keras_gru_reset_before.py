"""Keras' ``GRU(reset_after=False)``: one bias vector, the reset gate applied to the state
before the candidate's recurrent matmul. Its op against finite differences (plain, backwards,
under a Keras mask), a few SGD steps beside Keras from the same ``.keras`` weights, the
``.keras`` export reloaded by Keras and the ONNX ``GRU`` (``linear_before_reset=0``) run by
onnxruntime."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.gradcheck import gradcheck
from support.keras_steps import exports_predict, follows_keras, logits, softmax, train_beside_keras
from support.ophost import backward, compile_op

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.recurrent import GRUResetBefore
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
B, T, F = 3, 5, 2
MASK = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]], np.float64)


@pytest.mark.parametrize(
    "kw",
    [
        {"return_sequences": True},
        {"go_backwards": True},
        {"masked": True, "return_sequences": True, "zero_output_for_mask": True},
    ],
    ids=["seq", "backwards-last", "masked-seq"],
)
def test_reset_before_gradients_match_finite_differences(kw, rng):
    op = GRUResetBefore((T, F), 3, **kw)
    ws = compile_op(op, B)
    x = rng.normal(size=(B, T, F))
    params = {p.name: rng.normal(0, 0.5, p.shape) for p in op.params(0)}
    assert params["bias"].shape == (9,)
    w = rng.normal(size=(B, *op.out_shape))
    xs = [x, MASK] if op.masked else [x]

    def loss():
        return float(np.sum(op.forward(ws, *xs, **params) * w))

    loss()
    dxs, grads = backward(op, ws, xs, params, w.copy())
    gradcheck(loss, x, dxs[0], what="input")
    for name, g in grads.items():
        gradcheck(loss, params[name], g, rng=rng, samples=25, what=name)


def test_reset_before_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((T, F)),
            L.GRU(4, reset_after=False, return_sequences=True),
            L.GRU(3, reset_after=False, go_backwards=True),
            L.Dense(3, "softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(40, T, F)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 3, 8, n_train=32)
    try:
        out = softmax(logits(t, x[32:]))
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    follows_keras(ours, theirs, weights, km, rtol=1e-4, atol=1e-5)
    want = km.predict(x[32:], verbose=0)
    np.testing.assert_allclose(out, want, atol=2e-5)
    back = exports_predict(config, weights, x[32:], want, tmp_path)
    assert back.layers[0].reset_after is False


def test_reset_before_with_recurrent_dropout_is_refused_by_name():
    layer = L.GRU(4, reset_after=False, recurrent_dropout=0.2)
    config = json.loads(keras.Sequential([L.Input((T, F)), layer]).to_json())
    with pytest.raises(InvalidSpec, match=r"recurrent_dropout=0\.2 is not supported"):
        parse(config, compiled=False)
