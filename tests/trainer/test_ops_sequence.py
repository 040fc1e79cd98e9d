"""The sequence and attention ops (Dense on any rank, Embedding, LayerNormalization,
MultiHeadAttention, LSTM, GRU) against finite differences through the op protocol, in float64:
every input gradient in full, every weight gradient on a sample, and weight gradients cut into
row blocks equal to the whole. Their agreement with the real Keras layers is
``test_ops_sequence_keras.py``'s (TensorFlow is slow to import)."""

import inspect
import itertools

import numpy as np
import pytest
from support.gradcheck import gradcheck
from support.ophost import backward, compile_op

from ringtrain_trainer.engine.ops import (
    attention,
    bidirectional,
    dense,
    embedding,
    norm,
    recurrent,
    recurrent_gru,
    recurrent_lstm,
)
from ringtrain_trainer.engine.ops.attention import MultiHeadAttention
from ringtrain_trainer.engine.ops.bidirectional import Bidirectional
from ringtrain_trainer.engine.ops.dense import Dense, product_rows
from ringtrain_trainer.engine.ops.embedding import Embedding
from ringtrain_trainer.engine.ops.norm import LayerNorm
from ringtrain_trainer.engine.ops.recurrent import GRU, LSTM, SimpleRNN
from ringtrain_trainer.engine.ops.recurrent_gru import GRUResetBefore

B = 3


def _float(shape):
    return lambda rng: rng.normal(size=(B, *shape))


def _ids(shape, vocab):
    return lambda rng: rng.integers(0, vocab, size=(B, *shape)).astype(np.float64)


def _mask(t, s):
    def make(rng):
        m = (rng.random((B, t, s)) > 0.3).astype(np.float64)
        m[:, :, 0] = 1  # no fully masked row: finite differences need a smooth softmax
        return m

    return make


#: Bidirectional's merge modes, each with sequences or the last state
BIDIRECTIONAL = [("concat", True), ("concat", False), ("sum", True), ("ave", False), ("mul", True)]
#: name → (op, input makers; a maker of data marks an input without a gradient)
CASES = {
    "dense-3d-tanh": (Dense((4, 5), 3, "tanh"), [_float((4, 5))]),
    "dense-4d-nobias-relu": (Dense((2, 3, 4), 2, "relu", False), [_float((2, 3, 4))]),
    "dense-3d-gelu": (Dense((4, 5), 3, "gelu"), [_float((4, 5))]),
    "dense-3d-softmax": (Dense((4, 5), 3, "softmax"), [_float((4, 5))]),
    "embedding": (Embedding((6,), 5, 3), [_ids((6,), 5)]),
    "embedding-2d-ids": (Embedding((2, 3), 4, 2), [_ids((2, 3), 4)]),
    "layernorm": (LayerNorm((4, 5), 1e-3), [_float((4, 5))]),
    "layernorm-center-only": (LayerNorm((6,), 1e-5, scale=False), [_float((6,))]),
    "layernorm-scale-only": (LayerNorm((2, 3), 1e-3, center=False), [_float((2, 3))]),
    "mha-self": (MultiHeadAttention([(4, 6)], 2, 3), [_float((4, 6))]),
    "mha-self-causal-nobias": (
        MultiHeadAttention([(5, 4)], 3, 2, use_bias=False, causal=True),
        [_float((5, 4))],
    ),
    "mha-self-dropout": (
        MultiHeadAttention([(4, 6)], 2, 3, dropout=0.4, index=3),
        [_float((4, 6))],
    ),
    "mha-query-value": (
        MultiHeadAttention([(3, 4), (5, 6)], 2, 3, value_dim=2),
        [_float((3, 4)), _float((5, 6))],
    ),
    "mha-query-value-key-mask-causal": (
        MultiHeadAttention([(4, 4), (4, 3), (4, 5)], 2, 2, causal=True, mask_input=True),
        [_float((4, 4)), _float((4, 3)), _float((4, 5)), _mask(4, 4)],
    ),
    "lstm-last": (LSTM((5, 3), 4), [_float((5, 3))]),
    "lstm-seq-nobias": (LSTM((4, 2), 3, use_bias=False, return_sequences=True), [_float((4, 2))]),
    "lstm-relu-tanh": (LSTM((3, 2), 2, "relu", "tanh", return_sequences=True), [_float((3, 2))]),
    "gru-last": (GRU((5, 3), 4), [_float((5, 3))]),
    "gru-reset-before-seq": (
        GRUResetBefore((4, 3), 3, return_sequences=True),
        [_float((4, 3))],
    ),
    "simple-rnn-seq": (SimpleRNN((4, 3), 3, return_sequences=True), [_float((4, 3))]),
    "simple-rnn-backwards-relu": (
        SimpleRNN((4, 2), 3, "relu", use_bias=False, go_backwards=True),
        [_float((4, 2))],
    ),
    "lstm-backwards-seq": (
        LSTM((4, 2), 3, return_sequences=True, go_backwards=True),
        [_float((4, 2))],
    ),
    "gru-backwards": (GRU((4, 2), 3, go_backwards=True), [_float((4, 2))]),
    "gru-seq-nobias": (GRU((4, 2), 3, use_bias=False, return_sequences=True), [_float((4, 2))]),
    **{
        f"bidirectional-{mode}-{'seq' if seq else 'last'}": (
            Bidirectional(
                LSTM((4, 2), 3, return_sequences=seq),
                (LSTM if seq else GRU)((4, 2), 3, return_sequences=seq, go_backwards=True),
                mode,
            ),
            [_float((4, 2))],
        )
        for mode, seq in BIDIRECTIONAL
    },
}
DATA = {"embedding", "embedding-2d-ids"}


def test_every_sequence_op_class_has_a_gradient_check():
    mods = [attention, bidirectional, dense, embedding, norm]
    mods += [recurrent, recurrent_gru, recurrent_lstm]
    ops = {
        c
        for m in mods
        for _, c in inspect.getmembers(m, inspect.isclass)
        if hasattr(c, "forward") and c.__module__ == m.__name__ and not c.__name__.startswith("_")
    }
    assert len(ops) == 9
    assert ops - {type(op) for op, _ in CASES.values()} == set()


def _setup(case, rng):
    op, makers = CASES[case]
    ws = compile_op(op, B)
    xs = [m(rng) for m in makers]
    params = {p.name: rng.normal(0, 0.5, p.shape) for p in op.params(0)}
    w = rng.normal(size=(B, *op.out_shape))
    return op, ws, xs, params, w


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(case, rng):
    op, ws, xs, params, w = _setup(case, rng)

    def loss():
        return float(np.sum(op.forward(ws, *xs, **params) * w))

    loss()
    dxs, grads = backward(op, ws, xs, params, w.copy())
    for k, (x, dx) in enumerate(zip(xs, dxs, strict=True)):
        if case in DATA or (getattr(op, "mask_input", False) and k == len(xs) - 1):
            assert dx is None
        else:
            gradcheck(loss, x, dx, what=f"{case} input {k}")
    for name, g in grads.items():
        gradcheck(loss, params[name], g, rng=rng, samples=25, what=f"{case} {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_weight_gradients_in_row_blocks_equal_the_whole(case, rng):
    op, ws, xs, params, w = _setup(case, rng)
    op.forward(ws, *xs, **params)
    _, whole = backward(op, ws, xs, params, w)
    for p in op.params(0):
        blocks = np.full(p.shape, np.nan)
        cut = sorted({0, p.rows, *rng.integers(0, p.rows + 1, 3)})
        for lo, hi in itertools.pairwise(cut):
            op.backward_weights(ws, w, p.name, blocks, (lo, hi))
        np.testing.assert_allclose(blocks, whole[p.name], rtol=1e-12, atol=1e-14, err_msg=p.name)


def test_product_rows_streams_any_grid_of_a_product_with_the_whole_products_bits(rng):
    """An attention kernel (d, heads, k) streams in (d·heads, k) rows of a (d, heads·k) product:
    whatever the grid, the blocks asked in order give the whole product's bits — it is written
    whole at the first block and the later blocks only announce rows already written (BLAS may
    sum a cut product in another order; issue 34)."""
    a, d = rng.normal(size=(7, 3)), rng.normal(size=(7, 8))
    whole = np.empty((3, 4, 2))
    np.matmul(a.T, d, out=whole.reshape(3, 8))
    for grid in ([(0, 12)], [(0, 1), (1, 3), (3, 9), (9, 12)], [(0, 5), (5, 6), (6, 12)]):
        grad = np.full((3, 4, 2), np.nan)
        for i, rows in enumerate(grid):
            before = grad.copy()
            product_rows(a, d, grad, rows)
            if i == 0:
                assert grad.tobytes() == whole.tobytes()
            else:
                assert grad.tobytes() == before.tobytes()  # nothing rewritten


def test_embedding_refuses_an_id_outside_the_vocabulary():
    op = Embedding((3,), 4, 2)
    ws = compile_op(op, 1)
    with pytest.raises(ValueError, match=r"token id 4 is outside \[0, 4\)"):
        op.forward(ws, np.array([[0.0, 4.0, 1.0]]), np.zeros((4, 2)))


def test_a_fully_masked_query_attends_uniformly_like_keras(rng):
    op = MultiHeadAttention([(2, 3)], 1, 2, mask_input=True)
    ws = compile_op(op, 1)
    x = rng.normal(size=(1, 2, 3))
    params = {p.name: rng.normal(size=p.shape) for p in op.params(0)}
    op.forward(ws, x, np.array([[[0.0, 0.0], [1.0, 0.0]]]), **params)
    np.testing.assert_allclose(ws["att"][0, 0], [[0.5, 0.5], [1.0, 0.0]])


def test_rnn_refuses_an_activation_it_cannot_differentiate():
    with pytest.raises(ValueError, match="recurrent_activation='hard_sigmoid'"):
        LSTM((3, 2), 2, recurrent_activation="hard_sigmoid")


def test_forward_and_backward_allocate_nothing_per_step(rng):
    """After a first step, a float32 step of every op reuses its planned buffers: the tensors it
    hands on are the same arrays."""
    for case, (op, makers) in CASES.items():
        ws = compile_op(op, B, np.float32)
        xs = [m(rng).astype(np.float32) for m in makers]
        params = {p.name: rng.normal(0, 0.5, p.shape).astype(np.float32) for p in op.params(0)}
        w = rng.normal(size=(B, *op.out_shape)).astype(np.float32)
        outs = [op.forward(ws, *xs, **params) for _ in range(2)]
        assert outs[0] is outs[1] and outs[0].dtype == np.float32, case
        op.backward_local(ws, w)
        dx = op.backward_input(ws, w, **params)
        for d in dx if isinstance(dx, tuple) else (dx,):
            assert d is None or (d.dtype == np.float32 and any(d is v for v in ws.values())), case


def test_dense_refuses_an_activation_the_table_does_not_have():
    with pytest.raises(ValueError, match="no_such_activation"):
        Dense((3, 4), 2, "no_such_activation")
