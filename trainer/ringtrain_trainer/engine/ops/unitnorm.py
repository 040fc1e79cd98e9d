"""Keras ``UnitNormalization`` over the last axis: each example's vector (per position) scaled
to unit L2 norm. Keras 3 computes ``x * minimum(rsqrt(sum(x²)), 1 / 1e-12)`` (``ops.normalize``
with ``order=2``); the same formula here, so a zero vector maps to zero, as in Keras.

Backward, with ``y = x * inv`` and ``inv = 1 / ‖x‖``: ``dx = inv * (dy - y * sum(dy * y))``;
where the clip holds (``‖x‖ < 1e-12``) ``inv`` is a constant and ``dx = inv * dy``, the
``free`` flag kept from forward switches the second term off for those rows.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

#: Keras' ``UnitNormalization`` passes ``epsilon=1e-12`` to ``ops.normalize``
EPSILON = 1e-12


class UnitNormWs(TypedDict, total=False):
    """The buffers :class:`UnitNorm` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    free: np.ndarray
    inv: np.ndarray
    out: np.ndarray
    s: np.ndarray
    tmp: np.ndarray


class UnitNorm(Op):
    """``x / max(‖x‖₂, epsilon)`` along the last axis of ``(b, *lead, d)`` (``Dot``'s
    ``normalize=True`` uses it with Keras' default epsilon, 1e-7)."""

    kind = "unit_norm"

    def __init__(self, shape, epsilon: float = EPSILON):
        self.in_shape = self.out_shape = tuple(shape)
        self.epsilon = epsilon
        self.d, self.lead = self.in_shape[-1], math.prod(self.in_shape[:-1])

    def buffers(self, b, train, need_dx):
        n = b * self.lead
        bufs = self.out_and_dx(b, train, need_dx)
        bufs.update({"inv": ((n, 1), "f"), "free": ((n, 1), "f")})
        if train:
            bufs.update({"s": ((n, 1), "f"), "tmp": ((n, self.d), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        return 3 * b * self.lead * self.d * (1 + 2 * train)

    def forward(self, ws: UnitNormWs, x):
        x2, inv, free = x.reshape(-1, self.d), ws["inv"], ws["free"]
        np.einsum("ij,ij->i", x2, x2, out=inv[:, 0])
        np.greater(inv, self.epsilon**2, out=free)  # norm > eps: rsqrt below the clip
        np.sqrt(inv, out=inv)
        with np.errstate(divide="ignore"):
            np.reciprocal(inv, out=inv)
        np.minimum(inv, 1.0 / self.epsilon, out=inv)
        out = ws["out"]
        np.multiply(x2, inv, out=out.reshape(-1, self.d))
        return out

    def backward_input(self, ws: UnitNormWs, dout):
        d2, y2 = dout.reshape(-1, self.d), ws["out"].reshape(-1, self.d)
        s, tmp, dx = ws["s"], ws["tmp"], ws["dx"]
        dx2 = dx.reshape(-1, self.d)
        np.einsum("ij,ij->i", d2, y2, out=s[:, 0])
        np.multiply(s, ws["free"], out=s)
        np.multiply(y2, s, out=tmp)
        np.subtract(d2, tmp, out=dx2)
        np.multiply(dx2, ws["inv"], out=dx2)
        return dx
