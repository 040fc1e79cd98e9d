"""Keras' ``Attention`` (dot and concat scores) and ``AdditiveAttention``: built by real Keras,
trained by ringtrain and by Keras from the same ``.keras`` file on the same batches (SGD, the
loss at every step), predictions equal, and the exports reloaded by Keras and run by
onnxruntime. The scores' scale weights start away from their initial ones so that a wrong
scale gradient shows."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort
from support.keras_steps import train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.score_attention import ScoreAttention
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.load import load

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 4, 8


def _model(kind: str) -> keras.Model:
    inp = L.Input((6, 4))
    q = L.Dense(4, activation="tanh")(inp)
    v = L.Dense(4 if kind.startswith("additive") else 5)(inp)  # additive: key is value
    if kind == "dot-causal-self":
        h = L.Attention(use_scale=True)([q, q], use_causal_mask=True)
    elif kind == "concat-key":
        k = L.Dense(4)(inp)
        h = L.Attention(use_scale=True, score_mode="concat")([q, v, k])
    else:
        h = L.AdditiveAttention()([q, v], use_causal_mask=kind.endswith("causal"))
    h = L.GlobalAveragePooling1D()(h)
    m = keras.Model(inp, L.Dense(3, activation="softmax")(h))
    m.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy")
    att = next(layer for layer in m.layers if "attention" in layer.name)
    att.set_weights([np.full(w.shape, 0.7, np.float32) for w in att.get_weights()])
    return m


@pytest.mark.parametrize("kind", ["dot-causal-self", "concat-key", "additive", "additive-causal"])
def test_attention_layers_train_like_keras_and_export(kind, tmp_path, rng):
    km = _model(kind)
    x = rng.normal(size=(40, 6, 4)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, STEPS, BATCH, n_train=32)
    try:
        assert any(isinstance(op, ScoreAttention) for op in t.spec.layers)
        np.testing.assert_allclose(ours, theirs, rtol=2e-5)
        assert ours[-1] != ours[0]
        prog = M.Program(t.spec, 8, False, state=t.ipu.state)
        prog.x[:] = x[32:]
        z = prog.forward(t.spec.views(t.params)).astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        want = km.predict(x[32:], verbose=0)
        np.testing.assert_allclose(p / p.sum(1, keepdims=True), want, atol=2e-6)
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    for ours_w, theirs_w in zip(weights, km.get_weights(), strict=True):
        np.testing.assert_allclose(ours_w, theirs_w, rtol=1e-4, atol=1e-6)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    np.testing.assert_allclose(back.predict(x[32:], verbose=0), want, atol=2e-6)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[32:]})[0], want, atol=2e-6)


@pytest.mark.parametrize(
    "layer,call,field",
    [
        (lambda: L.Attention(dropout=0.1), {}, "dropout=0.1"),
        (lambda: L.AdditiveAttention(), {"return_attention_scores": True}, "return_attention"),
    ],
)
def test_what_would_run_differently_is_refused_by_name(layer, call, field, tmp_path):
    inp = L.Input((6, 4))
    h = layer()([inp, inp], **call)
    h = h[0] if isinstance(h, tuple | list) else h
    km = keras.Model(inp, L.Dense(2)(L.Flatten()(h)))
    km.save(tmp_path / "m.keras")
    with pytest.raises(InvalidSpec, match=field):
        load(str(tmp_path / "m.keras"))
