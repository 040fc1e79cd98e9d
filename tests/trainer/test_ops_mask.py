"""Masked ops against finite differences (``support.gradcheck``, one helper): the RNNs with
``masked=True`` (forward, go_backwards, ``zero_output_for_mask``, inside Bidirectional), the
masked global average, ``Masking``'s op and the mask-computing ops (no gradient). Plus the
forward rules Keras' masked loop states: a masked step keeps the state and repeats the output.
"""

import numpy as np
import pytest
from support.gradcheck import gradcheck
from support.ophost import backward, compile_op

from ringtrain_trainer.engine.ops.bidirectional import Bidirectional
from ringtrain_trainer.engine.ops.mask import ApplyMask, AttentionMask, ComputeMask
from ringtrain_trainer.engine.ops.pool import GlobalPool
from ringtrain_trainer.engine.ops.recurrent import GRU, LSTM, SimpleRNN

B, T = 3, 5
#: per example: right padding, left padding, a hole; every example keeps a step
MASK = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]], np.float64)


def _rnn(cls, **kw):
    return cls((T, 2), 3, masked=True, **kw)


CASES = {
    "lstm-last": _rnn(LSTM),
    "lstm-seq-backwards": _rnn(LSTM, return_sequences=True, go_backwards=True),
    "lstm-seq-zero-output": _rnn(LSTM, return_sequences=True, zero_output_for_mask=True),
    "gru-last-backwards": _rnn(GRU, go_backwards=True),
    "gru-seq": _rnn(GRU, return_sequences=True),
    "gru-last-zero-output": _rnn(GRU, zero_output_for_mask=True),
    "simple-rnn-seq": _rnn(SimpleRNN, return_sequences=True),
    "bidirectional-gru-concat-seq": Bidirectional(
        _rnn(GRU, return_sequences=True, zero_output_for_mask=True),
        _rnn(GRU, return_sequences=True, go_backwards=True, zero_output_for_mask=True),
        "concat",
    ),
    "bidirectional-lstm-sum-last": Bidirectional(_rnn(LSTM), _rnn(LSTM, go_backwards=True), "sum"),
    "global-average-1d": GlobalPool((T, 4), "avg", masked=True),
    "masking": ApplyMask((T, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_masked_op_gradients_match_finite_differences(case, rng):
    op = CASES[case]
    ws = compile_op(op, B)
    x = rng.normal(size=(B, *op.in_shape))
    params = {p.name: rng.normal(0, 0.5, p.shape) for p in op.params(0)}
    w = rng.normal(size=(B, *op.out_shape))

    def loss():
        return float(np.sum(op.forward(ws, x, MASK, **params) * w))

    loss()
    (dx, dmask), grads = backward(op, ws, [x, MASK], params, w.copy())
    assert dmask is None  # the mask is data
    gradcheck(loss, x, dx, what=f"{case} input")
    for name, g in grads.items():
        gradcheck(loss, params[name], g, rng=rng, samples=25, what=f"{case} {name}")


def test_a_masked_step_keeps_the_state_and_repeats_the_output(rng):
    """Keras' ``backend.rnn``: masked steps return the previous output (zeros before the
    first unmasked one), or zeros with ``zero_output_for_mask``; the last state is the one of
    the last unmasked step: the same as running the unmasked steps alone."""
    op, zo = (
        _rnn(LSTM, return_sequences=True),
        _rnn(LSTM, return_sequences=True, zero_output_for_mask=True),
    )
    params = {p.name: rng.normal(0, 0.5, p.shape) for p in op.params(0)}
    x = rng.normal(size=(B, T, 2))
    y = np.array(op.forward(compile_op(op, B), x, MASK, **params))
    y0 = np.array(zo.forward(compile_op(zo, B), x, MASK, **params))
    np.testing.assert_array_equal(y[0, 3], y[0, 2])
    np.testing.assert_array_equal(y[1, :2], 0)
    np.testing.assert_array_equal(y[2, 1], y[2, 0])
    np.testing.assert_array_equal(y0 * MASK[..., None], y0)
    np.testing.assert_allclose(y0[MASK == 1], y[MASK == 1])
    plain = LSTM((2, 2), 3)
    last = plain.forward(compile_op(plain, 1), x[1:2, 2:4], **params)
    np.testing.assert_allclose(y[1, 3], last[0])


def test_mask_ops_compute_keras_masks_and_take_no_gradient():
    ids = np.array([[3, 0, 1], [0, 0, 2]], np.float64)
    zero = ComputeMask((3,), "zero")
    np.testing.assert_array_equal(zero.forward(compile_op(zero, 2), ids), [[1, 0, 1], [0, 0, 1]])
    x = np.zeros((2, 3, 2))
    x[0, 0, 1] = 5.0
    x[1, 2] = 1.0
    value = ComputeMask((3, 2), "value", 1.0)
    np.testing.assert_array_equal(value.forward(compile_op(value, 2), x), [[1, 1, 1], [1, 1, 0]])
    either = ComputeMask((3,), "or", n=2)
    got = either.forward(compile_op(either, 2), ids != 0, np.array([[0, 1, 0], [1, 0, 0.0]]))
    np.testing.assert_array_equal(got, [[1, 1, 1], [1, 0, 1]])
    att = AttentionMask(3, 2, ("query", "value"))
    got = att.forward(compile_op(att, 1), np.array([[1, 0, 1.0]]), np.array([[0, 1.0]]))
    np.testing.assert_array_equal(got[0], [[0, 1], [0, 0], [0, 1]])
    assert att.backward_input({}, None) == (None, None)
    assert zero.backward_input({}, None) is None


def test_masked_ops_reuse_their_planned_buffers_every_step(rng):
    """A float32 step of every masked op writes into its planned buffers: what it hands on is
    the same array each step, its input gradient one of its buffers."""
    for case, op in CASES.items():
        ws = compile_op(op, B, np.float32)
        x = rng.normal(size=(B, *op.in_shape)).astype(np.float32)
        m = MASK.astype(np.float32)
        params = {p.name: rng.normal(0, 0.5, p.shape).astype(np.float32) for p in op.params(0)}
        w = rng.normal(size=(B, *op.out_shape)).astype(np.float32)
        outs = [op.forward(ws, x, m, **params) for _ in range(2)]
        assert outs[0] is outs[1] and outs[0].dtype == np.float32, case
        op.backward_local(ws, w)
        dx, dmask = op.backward_input(ws, w, **params)
        assert dmask is None and dx.dtype == np.float32, case
        assert any(dx is v for v in ws.values()), case
