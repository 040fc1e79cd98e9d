"""The sequence and attention ops against the real Keras layers (Keras 3, TensorFlow CPU), in
float32 from the same weights (``set_weights`` in the op's parameter order, which must be
Keras' own): forward on random inputs within 1e-5 (1e-4 for LSTM and GRU, whose error grows
along the sequence), and the weight and input gradients of ``sum(out * w)`` against
``tf.GradientTape``."""

import os

import numpy as np
import pytest
from support.ophost import backward, compile_op

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf

from ringtrain_trainer.engine.ops.attention import MultiHeadAttention
from ringtrain_trainer.engine.ops.bidirectional import Bidirectional
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.embedding import Embedding
from ringtrain_trainer.engine.ops.norm import LayerNorm
from ringtrain_trainer.engine.ops.recurrent import GRU, LSTM, SimpleRNN

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)

B, L = 4, 1e-5
F32 = np.float32


def _x(rng, *shape):
    return rng.normal(size=(B, *shape)).astype(F32)


def _causal_mask(rng, t, s):
    m = rng.random((B, t, s)) > 0.3
    m[:, :, 0] = True
    return m


#: name → (our op, the Keras layer, input maker, call kwargs maker, tolerance)
CASES = {
    "dense-3d": (
        lambda: Dense((5, 6), 3, "tanh"),
        lambda: keras.layers.Dense(3, activation="tanh"),
        lambda rng: [_x(rng, 5, 6)],
        L,
    ),
    "embedding": (
        lambda: Embedding((7,), 11, 4),
        lambda: keras.layers.Embedding(11, 4),
        lambda rng: [rng.integers(0, 11, (B, 7)).astype(F32)],
        L,
    ),
    "layernorm": (
        lambda: LayerNorm((5, 8), 1e-3),
        lambda: keras.layers.LayerNormalization(epsilon=1e-3),
        lambda rng: [_x(rng, 5, 8) * 3 + 1],
        L,
    ),
    "layernorm-no-scale": (
        lambda: LayerNorm((8,), 1e-6, scale=False),
        lambda: keras.layers.LayerNormalization(epsilon=1e-6, scale=False),
        lambda rng: [_x(rng, 8)],
        L,
    ),
    "mha-self": (
        lambda: MultiHeadAttention([(6, 8)], 2, 4),
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=4),
        lambda rng: [_x(rng, 6, 8)],
        L,
    ),
    "mha-causal-cross": (
        lambda: MultiHeadAttention([(5, 8), (5, 6), (5, 3)], 3, 2, 4, causal=True, mask_input=True),
        lambda: keras.layers.MultiHeadAttention(num_heads=3, key_dim=2, value_dim=4),
        lambda rng: [_x(rng, 5, 8), _x(rng, 5, 6), _x(rng, 5, 3), _causal_mask(rng, 5, 5)],
        L,
    ),
    "lstm": (
        lambda: LSTM((7, 5), 6),
        lambda: keras.layers.LSTM(6),
        lambda rng: [_x(rng, 7, 5)],
        1e-4,
    ),
    "lstm-sequences": (
        lambda: LSTM((6, 3), 4, use_bias=False, return_sequences=True),
        lambda: keras.layers.LSTM(4, use_bias=False, return_sequences=True),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "lstm-backwards": (
        lambda: LSTM((6, 3), 4, return_sequences=True, go_backwards=True),
        lambda: keras.layers.LSTM(4, return_sequences=True, go_backwards=True),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "gru-backwards": (
        lambda: GRU((6, 3), 4, go_backwards=True),
        lambda: keras.layers.GRU(4, go_backwards=True),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "bidirectional-concat": (
        lambda: Bidirectional(
            LSTM((6, 3), 4, return_sequences=True),
            LSTM((6, 3), 4, return_sequences=True, go_backwards=True),
        ),
        lambda: keras.layers.Bidirectional(
            keras.layers.LSTM(4, return_sequences=True, name="lstm")  # Keras numbers names
        ),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "bidirectional-mul": (
        lambda: Bidirectional(GRU((6, 3), 4), GRU((6, 3), 4, go_backwards=True), "mul"),
        lambda: keras.layers.Bidirectional(keras.layers.GRU(4, name="gru"), merge_mode="mul"),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "simple-rnn-backwards": (
        lambda: SimpleRNN((6, 3), 4, return_sequences=True, go_backwards=True),
        lambda: keras.layers.SimpleRNN(4, return_sequences=True, go_backwards=True),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
    "gru": (
        lambda: GRU((7, 5), 6),
        lambda: keras.layers.GRU(6),
        lambda rng: [_x(rng, 7, 5)],
        1e-4,
    ),
    "gru-sequences": (
        lambda: GRU((6, 3), 4, return_sequences=True),
        lambda: keras.layers.GRU(4, return_sequences=True),
        lambda rng: [_x(rng, 6, 3)],
        1e-4,
    ),
}


def _keras_call(case, layer, xs):
    if case == "mha-self":
        return layer(xs[0], xs[0])
    if case.startswith("mha"):
        q, v, k, m = xs
        return layer(q, v, key=k, attention_mask=m, use_causal_mask=True)
    return layer(xs[0])


def _keras_names(layer):
    """Keras' weight paths with the layer's own prefix dropped: ``query/kernel``, ``kernel``."""
    names = []
    for w in layer.weights:
        parts = w.path.split("/")[1:]
        names.append("/".join(p for p in parts if not p.endswith("_cell")))
    return names


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_keras(case, rng):
    make_op, make_layer, make_x, tol = CASES[case]
    op, layer, xs = make_op(), make_layer(), make_x(rng)
    tx = [tf.constant(x) for x in xs]
    _keras_call(case, layer, tx)  # builds the layer
    specs = op.params(0)
    mha, bi = case.startswith("mha"), case.startswith("bidirectional")
    cell = "lstm" if "concat" in case else "gru"
    ours = [
        "/".join(s.name.rsplit("_", 1))
        if mha
        else s.name.replace("_", f"_{cell}/", 1)
        if bi
        else s.name
        for s in specs
    ]
    assert ours == _keras_names(layer)
    params = {s.name: rng.normal(0, 0.4, s.shape).astype(F32) for s in specs}
    layer.set_weights([params[s.name] for s in specs])

    ws = compile_op(op, B, F32)
    out = np.array(op.forward(ws, *xs, **params))
    w = rng.normal(size=out.shape).astype(F32)
    dxs, grads = backward(op, ws, xs, params, w)
    float_in = [k for k, x in enumerate(xs) if x.dtype == F32 and not case.startswith("embed")]
    if case.startswith("mha-causal"):
        float_in = float_in[:3]
    with tf.GradientTape() as tape:
        for k in float_in:
            tape.watch(tx[k])
        y = _keras_call(case, layer, tx)
        loss = tf.reduce_sum(y * w)
    np.testing.assert_allclose(out, y.numpy(), rtol=tol, atol=tol, err_msg="forward")
    kgrads = tape.gradient(loss, [*layer.trainable_weights, *(tx[k] for k in float_in)])
    for s, g in zip(specs, kgrads, strict=False):
        g = tf.convert_to_tensor(g).numpy()  # an Embedding's gradient is IndexedSlices
        np.testing.assert_allclose(grads[s.name], g, rtol=tol, atol=tol * 10, err_msg=s.name)
    for k, g in zip(float_in, kgrads[len(specs) :], strict=True):
        np.testing.assert_allclose(dxs[k], g.numpy(), rtol=tol, atol=tol * 10, err_msg=f"x{k}")
