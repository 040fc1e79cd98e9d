"""Two-input element-wise ops whose inputs broadcast — Keras 3's ``Add``/``Subtract``/
``Multiply`` layers (and ``x * y`` on Keras tensors) accept per-example shapes of one rank that
broadcast, which squeeze-and-excitation blocks rely on: ``Multiply()([x, se])`` with ``x`` of
(H, W, C) and ``se`` of (1, 1, C), as in EfficientNet and MobileNetV3.

Equal shapes stay with ``merge.Merge``; this op is only built when the shapes differ. Each
input's gradient is the output's, reduced (summed) over the axes that input was broadcast along
— into a buffer of that input's shape planned at compile time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op

UFUNCS = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply}


def broadcast_shape(shapes) -> tuple[int, ...]:
    """The broadcast per-example shape, or ValueError naming why not (ranks must match: the
    batch axis is not among the shapes, so left-padding would misalign it)."""
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"inputs of ranks {[len(s) for s in shapes]} (supported: one rank)")
    out = []
    for dims in zip(*shapes, strict=True):
        big = max(dims)
        if any(d not in (1, big) for d in dims):
            raise ValueError(f"inputs of shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(big)
    return tuple(out)


class Broadcast(Op):
    """``x0 (op) x1`` with numpy broadcasting over the per-example axes."""

    def __init__(self, in_shapes, mode: str):
        if mode not in UFUNCS or len(in_shapes) != 2:
            raise ValueError(f"broadcasting {mode!r} of {len(in_shapes)} inputs")
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.out_shape = broadcast_shape(self.in_shapes)
        self.mode, self.n_inputs = mode, 2
        #: per input, the axes of the batched tensor its gradient is summed over
        self.reduce = [
            tuple(i + 1 for i, (d, o) in enumerate(zip(s, self.out_shape, strict=True)) if d != o)
            for s in self.in_shapes
        ]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train and need_dx:
            bufs["full"] = ((b, *self.out_shape), "f")
            bufs.update({f"dx{k}": ((b, *s), "f") for k, s in enumerate(self.in_shapes)})
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (1 + 3 * train)

    def forward(self, ws: dict[str, Any], x0, x1):
        ws["xs"] = (x0, x1)
        return UFUNCS[self.mode](x0, x1, out=ws["out"])

    def backward_input(self, ws: dict[str, Any], dout):
        dout = dout.reshape(ws["out"].shape)
        full, xs = ws["full"], ws["xs"]
        out = []
        for k in range(2):
            if self.mode == "multiply":
                np.multiply(dout, xs[1 - k], out=full)
            elif self.mode == "subtract" and k == 1:
                np.negative(dout, out=full)
            else:
                np.copyto(full, dout)
            dx = ws[f"dx{k}"]
            if self.reduce[k]:
                np.sum(full, axis=self.reduce[k], keepdims=True, out=dx)
            else:
                np.copyto(dx, full)
            out.append(dx)
        return tuple(out)
