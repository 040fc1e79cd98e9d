"""The LSTM's and GRU's fast path (``engine.ops.recurrent_fast``: time- and unit-major buffers,
one product per step) against their per-step loop (``recurrent_loop``, what a masked or
``recurrent_dropout`` cell runs, checked against Keras in test_ops_sequence_keras and
test_keras_recurrent_dropout): the output, the input gradient and every weight gradient agree
to rounding in float64, for every direction, output form and bias, run twice on one workspace
(nothing left over from a previous step)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.ophost import backward, compile_op

from ringtrain_trainer.engine.ops.recurrent import GRU, LSTM

B, T, F, U = 5, 6, 3, 4
CASES = list(itertools.product([False, True], [False, True], [True, False]))


def _run(cls, fast, seq, back, bias, dtype):
    op = cls((T, F), U, return_sequences=seq, go_backwards=back, use_bias=bias)
    assert op.fast  # Keras' default activations, no mask, no recurrent_dropout
    op.fast = fast
    ws = compile_op(op, B, dtype)
    rng = np.random.default_rng(1)
    params = {p.name: rng.normal(0, 0.5, p.shape).astype(dtype) for p in op.params(0)}
    x = rng.normal(0, 1, (B, T, F)).astype(dtype)
    dout = None
    for step in range(2):
        y = np.array(op.forward(ws, x * (step + 1), **params))
        if dout is None:
            dout = np.random.default_rng(2).normal(0, 1, y.shape).astype(dtype)
        dxs, grads = backward(op, ws, [x], params, dout)
    return y, dxs[0], grads


@pytest.mark.parametrize("cls", [LSTM, GRU])
@pytest.mark.parametrize(("seq", "back", "bias"), CASES)
def test_fast_path_is_the_per_step_loop(cls, seq, back, bias):
    y, dx, grads = _run(cls, True, seq, back, bias, np.float64)
    y0, dx0, grads0 = _run(cls, False, seq, back, bias, np.float64)
    np.testing.assert_allclose(y, y0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(dx, dx0, rtol=0, atol=1e-14)
    assert grads.keys() == grads0.keys() and len(grads) == 2 + bias
    for k in grads:
        np.testing.assert_allclose(grads[k], grads0[k], rtol=0, atol=1e-13, err_msg=k)
        assert np.abs(grads[k]).max() > 1e-3, k  # a real gradient, not two zeros


@pytest.mark.parametrize("cls", [LSTM, GRU])
def test_fast_path_only_where_it_applies(cls):
    assert not cls((T, F), U, masked=True).fast
    assert not cls((T, F), U, recurrent_dropout=0.2).fast
    assert not cls((T, F), U, activation="relu").fast
    assert not cls((T, F), U, recurrent_activation="tanh").fast
