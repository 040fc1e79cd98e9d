"""Keras ``Dot(axes, normalize)`` of two inputs: per example, the contraction of one axis of
``x`` with one axis of ``y`` (Keras' ``batch_dot``). Two ``(d,)`` vectors give ``(1,)`` (a
recommender's user·item score); two ``(n, k)``/``(m, k)`` matrices give ``(n, m)``.

Both shapes are one batched matmul ``X @ Y`` with ``X`` ``(b, n, k)`` and ``Y`` ``(b, k, m)``:
a vector is ``n = 1`` or ``m = 1``, and an input contracted on its other axis is a transposed
view. Backward: ``dX = dout @ Yᵀ`` and ``dY = Xᵀ @ dout``, written straight into each input's
gradient buffer through the same views. ``normalize=True`` (cosine similarity) first scales
each input to unit L2 norm along the contracted axis with ``UnitNorm`` at Keras' default
epsilon (``ops.normalize``), whose backward then runs on the matmul's input gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.unitnorm import UnitNorm

#: ``keras.backend.epsilon()``: what ``Dot(normalize=True)``'s ``ops.normalize`` clips at
KERAS_EPSILON = 1e-7


class Dot(Op):
    """``batch_dot(x, y, axes)`` of two rank-1 or two rank-2 examples; ``axes`` 0-based per
    example (no batch axis)."""

    kind = "dot"
    n_inputs = 2

    def __init__(self, in_shapes, axes: tuple[int, int], normalize: bool = False):
        self.in_shapes = [tuple(s) for s in in_shapes]
        (sx, sy), (ax, ay) = self.in_shapes, axes
        if len(sx) != len(sy) or len(sx) not in (1, 2) or sx[ax] != sy[ay]:
            raise ValueError(f"Dot of shapes {sx}, {sy} on axes {axes} is not supported")
        self.axes, self.k = (ax, ay), sx[ax]
        self.vec = len(sx) == 1
        self.n = 1 if self.vec else sx[1 - ax]
        self.m = 1 if self.vec else sy[1 - ay]
        self.out_shape = (1,) if self.vec else (self.n, self.m)
        self.unit = [UnitNorm(s, KERAS_EPSILON) for s in self.in_shapes] if normalize else []
        if normalize and not (self.vec or axes == (1, 1)):
            raise ValueError("Dot(normalize=True) is supported on the last axis only")

    def _x(self, a: np.ndarray) -> np.ndarray:
        """``x``'s array (or gradient) as ``(b, n, k)``."""
        a = a.reshape(-1, *self.in_shapes[0])
        return a[:, None, :] if self.vec else a if self.axes[0] == 1 else a.transpose(0, 2, 1)

    def _y(self, a: np.ndarray) -> np.ndarray:
        """``y``'s array (or gradient) as ``(b, k, m)``."""
        a = a.reshape(-1, *self.in_shapes[1])
        return a[:, :, None] if self.vec else a if self.axes[1] == 0 else a.transpose(0, 2, 1)

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        for k, u in enumerate(self.unit):
            bufs.update({f"u{k}.{n}": v for n, v in u.buffers(b, train, need_dx).items()})
        if train and need_dx:
            bufs.update({f"dx{k}": ((b, *s), "f") for k, s in enumerate(self.in_shapes)})
        return bufs

    def flops(self, b, train, need_dx):
        return 2 * b * self.n * self.m * self.k * (1 + 2 * train)

    def _ws(self, ws: dict[str, Any], k: int) -> dict:
        p = f"u{k}."
        return {n[len(p) :]: v for n, v in ws.items() if n.startswith(p)}

    def bind(self, ws: dict[str, Any], b):
        ws["units"] = [self._ws(ws, k) for k in range(len(self.unit))]

    def forward(self, ws: dict[str, Any], x, y):
        if self.unit:
            x = self.unit[0].forward(ws["units"][0], x)
            y = self.unit[1].forward(ws["units"][1], y)
        out = ws["out"]
        np.matmul(self._x(x), self._y(y), out=out.reshape(-1, self.n, self.m))
        ws["xy"] = (x, y)
        return out

    def backward_input(self, ws: dict[str, Any], dout):
        x, y = ws["xy"]
        d3 = dout.reshape(-1, self.n, self.m)
        dx, dy = ws["dx0"], ws["dx1"]
        np.matmul(d3, self._y(y).transpose(0, 2, 1), out=self._x(dx))
        np.matmul(self._x(x).transpose(0, 2, 1), d3, out=self._y(dy))
        if self.unit:
            dx = self.unit[0].backward_input(ws["units"][0], dx)
            dy = self.unit[1].backward_input(ws["units"][1], dy)
        return dx, dy
