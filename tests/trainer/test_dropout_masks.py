"""``engine.ops.dropout.masks`` draws every example's mask from one Philox whose counter is set per
example; the values must be those of a fresh ``Philox`` + ``Generator.random(n, float32)`` per
example (what Dropout, SharedDropout, attention's dropout and the RNNs' ``recurrent_dropout``
drew before), to the last bit, for any row length and both float widths."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain_trainer.engine.ops.dropout import masks


def _reference(seed, layer, step, example0, rate, out):
    rows = out.reshape(out.shape[0], -1)
    scale = out.dtype.type(1.0 / (1.0 - rate))
    for e in range(rows.shape[0]):
        bits = np.random.Philox(key=[seed & (2**64 - 1), layer], counter=[0, 0, step, example0 + e])
        u = np.random.Generator(bits).random(rows.shape[1], np.float32)
        np.multiply(u >= rate, scale, out=rows[e], casting="unsafe")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4, 1), np.float32),
        ((32, 3, 8), np.float32),
        ((5, 4, 13), np.float64),
        ((3, 7, 9, 2), np.float32),
    ],
)
@pytest.mark.parametrize(
    ("seed", "layer", "step", "example0"), [(0, 1, 0, 0), (2**40 + 5, 2**21 + 4, 9, 96)]
)
def test_masks_equal_a_fresh_generator_per_example(shape, dtype, seed, layer, step, example0):
    got, want = np.full(shape, 7, dtype), np.full(shape, 7, dtype)
    masks(seed, layer, step, example0, 0.35, got)
    _reference(seed, layer, step, example0, 0.35, want)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert 0 < np.count_nonzero(got) < got.size or got.size < 8  # a real mix of kept and dropped


def test_masks_differ_by_example_step_and_layer():
    a, b, c = (np.zeros((6, 10), np.float32) for _ in range(3))
    masks(1, 2, 3, 0, 0.5, a)
    masks(1, 2, 4, 0, 0.5, b)
    masks(1, 3, 3, 0, 0.5, c)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert not all(np.array_equal(a[0], a[e]) for e in range(1, 6))
