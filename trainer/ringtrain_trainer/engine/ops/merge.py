"""Merge ops — Keras ``Add``, ``Subtract``, ``Multiply``, ``Average``, ``Maximum``, ``Minimum``
and ``Concatenate``: several inputs, one output, one input gradient per input.

The Program sums the input gradients of a tensor read by several nodes (a residual
connection), so these ops only say what each input's gradient is. Every buffer is planned at
compile time; a step writes into them. ``Maximum``/``Minimum`` send a tie's gradient to the
first input holding the extreme, as TensorFlow's pairwise ``maximum`` gradient does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op

MODES = ("add", "subtract", "multiply", "average", "maximum", "minimum")


class Merge(Op):
    """Element-wise merge of ``n_inputs`` tensors of one shape."""

    def __init__(self, shape, mode: str, n_inputs: int = 2):
        if mode not in MODES or n_inputs < 2 or (mode == "subtract" and n_inputs != 2):
            raise ValueError(f"merge {mode!r} of {n_inputs} inputs")
        self.in_shape = self.out_shape = tuple(shape)
        self.mode, self.n_inputs = mode, n_inputs

    def buffers(self, b, train, need_dx):
        shape = (b, *self.out_shape)
        bufs = {"out": (shape, "f")}
        if train and need_dx and self.mode != "add":
            n = 1 if self.mode == "average" else self.n_inputs
            bufs.update({f"dx{k}": (shape, "f") for k in range(n)})
            if self.mode in ("maximum", "minimum"):
                bufs.update({"hit": (shape, "b"), "taken": (shape, "b")})
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * self.n_inputs * (1 + train)

    def forward(self, ws: dict[str, Any], *xs):
        out, mode = ws["out"], self.mode
        ws["xs"] = xs
        if mode == "subtract":
            return np.subtract(xs[0], xs[1], out=out)
        ufunc = {
            "add": np.add,
            "average": np.add,
            "multiply": np.multiply,
            "maximum": np.maximum,
            "minimum": np.minimum,
        }[mode]
        ufunc(xs[0], xs[1], out=out)
        for x in xs[2:]:
            ufunc(out, x, out=out)
        if mode == "average":
            np.multiply(out, out.dtype.type(1 / self.n_inputs), out=out)
        return out

    def backward_input(self, ws: dict[str, Any], dout):
        mode, n = self.mode, self.n_inputs
        dout = dout.reshape(ws["out"].shape)
        if mode == "add":
            return (dout,) * n
        if mode == "average":
            np.multiply(dout, dout.dtype.type(1 / n), out=ws["dx0"])
            return (ws["dx0"],) * n
        dxs = [ws[f"dx{k}"] for k in range(n)]
        xs = ws["xs"]
        if mode == "subtract":
            np.copyto(dxs[0], dout)
            np.negative(dout, out=dxs[1])
        elif mode == "multiply":
            for k in range(n):
                np.copyto(dxs[k], dout)
                for j in range(n):
                    if j != k:
                        np.multiply(dxs[k], xs[j], out=dxs[k])
        else:
            hit, taken = ws["hit"], ws["taken"]
            taken.fill(False)
            for k in range(n):
                np.equal(xs[k], ws["out"], out=hit)
                np.greater(hit, taken, out=hit)  # hit and not yet taken
                np.logical_or(taken, hit, out=taken)
                np.multiply(dout, hit, out=dxs[k])
        return tuple(dxs)


class Concatenate(Op):
    """Keras ``Concatenate(axis)``: inputs joined along one per-example axis."""

    def __init__(self, in_shapes, axis: int):
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.n_inputs = len(self.in_shapes)
        rank = len(self.in_shapes[0])
        self.axis = axis % rank
        sizes = [s[self.axis] for s in self.in_shapes]
        out = list(self.in_shapes[0])
        out[self.axis] = sum(sizes)
        self.out_shape = tuple(out)
        #: each input's range along the axis
        self.cuts = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(self.n_inputs)]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train and need_dx:
            bufs.update({f"dx{k}": ((b, *s), "f") for k, s in enumerate(self.in_shapes)})
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (1 + train)

    def _part(self, a: np.ndarray, k: int) -> np.ndarray:
        lo, hi = self.cuts[k]
        return a[(slice(None),) * (self.axis + 1) + (slice(lo, hi),)]

    def forward(self, ws: dict[str, Any], *xs):
        out = ws["out"]
        for k, x in enumerate(xs):
            np.copyto(self._part(out, k), x.reshape((x.shape[0], *self.in_shapes[k])))
        return out

    def backward_input(self, ws: dict[str, Any], dout):
        dout = dout.reshape(ws["out"].shape)
        dxs = []
        for k in range(self.n_inputs):
            dx = ws[f"dx{k}"]
            np.copyto(dx, self._part(dout, k))
            dxs.append(dx)
        return tuple(dxs)
