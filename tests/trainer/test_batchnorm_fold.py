"""BatchNormalization's broadcast passes on a folded view (``(rows / k, k·c)``, the per-channel
vectors tiled): the same operations on the same elements, so the same bits as the unfolded
passes, in training (output, input gradient, the two sums, the moving statistics) and in the
inference-mode gradient a frozen BN takes (issue 39: BN was half of the BN CNN's step)."""

from __future__ import annotations

import numpy as np
import pytest
from support.ophost import compile_op

from ringtrain_trainer.engine.ops import batchnorm


def _step(shape, b, dtype, monkeypatch, width):
    monkeypatch.setattr(batchnorm, "FOLD_WIDTH", width)
    op = batchnorm.BatchNorm(shape, 0.8, 1e-3, True, True)
    ws = compile_op(op, b, dtype=dtype)
    rng = np.random.default_rng(0)
    x, dy = (rng.normal(size=(b, *shape)).astype(dtype) for _ in range(2))
    gamma, beta = (rng.normal(size=shape[-1]).astype(dtype) for _ in range(2))
    out = []
    for _ in range(2):  # twice: the moving statistics and the tiled vectors carry over
        out.append(op.forward(ws, x, gamma, beta).copy())
        op.backward_local(ws, dy)
        out.append(op.backward_input(ws, dy, gamma, beta).copy())
        out += [ws[k].copy() for k in ("s1", "s2", "moving_mean", "moving_variance")]
        out.append(op.backward_inference(ws, dy, gamma, beta).copy())
    return out, ws["k"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "shape,b,k",
    [((12, 12, 4), 64, 64), ((7, 5, 3), 3, 35), ((10,), 13, 13), ((6, 6, 64), 8, 4)],
    ids=["zoo-bn-cnn", "odd-rows", "prime-batch", "wide-channels"],
)
def test_the_folded_passes_give_the_unfolded_bits(shape, b, k, dtype, monkeypatch):
    folded, k_got = _step(shape, b, dtype, monkeypatch, 256)
    plain, k_one = _step(shape, b, dtype, monkeypatch, 1)
    assert (k_got, k_one) == (k, 1), "the fold took effect, and the reference did not fold"
    for i, (f, p) in enumerate(zip(folded, plain, strict=True)):
        assert f.tobytes() == p.tobytes(), i
    assert np.abs(folded[0]).sum() > 0 and np.abs(folded[1]).sum() > 0


def test_the_fold_divides_the_rows_within_the_width():
    assert batchnorm.fold(9216, 4) == 64  # 64 * 4 = 256
    assert batchnorm.fold(105, 3) == 35  # the largest divisor with k * 3 <= 256
    assert batchnorm.fold(13, 300) == 1  # wider than the width: no fold
    assert batchnorm.fold(9216, 4, width=100) == 24
