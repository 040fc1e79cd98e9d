"""Keras ``Bidirectional``: one RNN op over the sequence forwards and one backwards
(``go_backwards``), their outputs merged (concat, sum, ave or mul).

The two halves are ordinary :mod:`recurrent` ops on sub-workspaces of this op's own planned
buffers (keys prefixed ``f.`` and ``b.``), so backpropagation through time, buffer planning and
row-block weight gradients are theirs. As Keras does, a returned sequence of the backward half
is flipped back to timestep order before the merge — here as a reversed view, no copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.recurrent_loop import _Recurrent

MERGE_MODES = ("concat", "sum", "ave", "mul")
_HALVES = ("forward", "backward")


class Bidirectional(Op):
    """``forward`` and ``backward``: RNN ops on the same input (the second reading it in the
    other direction); parameters ``forward_<name>`` then ``backward_<name>``, Keras' order."""

    kind = "recurrent"

    def __init__(self, forward: _Recurrent, backward: _Recurrent, merge_mode: str = "concat"):
        if merge_mode not in MERGE_MODES:
            raise ValueError(f"Bidirectional: merge_mode={merge_mode!r} not in {MERGE_MODES}")
        if forward.in_shape != backward.in_shape or (
            forward.return_sequences != backward.return_sequences
        ):
            raise ValueError("Bidirectional: the halves must read one input, return alike")
        if merge_mode != "concat" and forward.u != backward.u:
            raise ValueError(f"Bidirectional: merge_mode={merge_mode!r} needs equal units")
        self.halves = {"forward": forward, "backward": backward}
        self.mode, self.seq = merge_mode, forward.return_sequences
        self.in_shape, self.uf = forward.in_shape, forward.u
        if forward.masked != backward.masked:
            raise ValueError("Bidirectional: both halves read the mask or neither")
        #: a masked wrapper reads ``(x, mask)`` and hands the mask to both halves
        self.masked, self.n_inputs, self.in_shapes = (
            forward.masked,
            forward.n_inputs,
            forward.in_shapes,
        )
        units = forward.u + backward.u if merge_mode == "concat" else forward.u
        self.out_shape = (*forward.out_shape[:-1], units)

    def params(self, layer):
        return [
            dataclasses.replace(p, name=f"{half}_{p.name}")
            for half in _HALVES
            for p in self.halves[half].params(layer)
        ]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        for half, op in self.halves.items():
            bufs.update({f"{half[0]}.{k}": v for k, v in op.buffers(b, train, need_dx).items()})
        if train:
            if self.mode in ("ave", "mul"):
                bufs["d_forward"] = bufs["d_backward"] = ((b, *self.out_shape), "f")
                if self.mode == "ave":
                    del bufs["d_backward"]
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return sum(op.flops(b, train, need_dx) for op in self.halves.values())

    def bind(self, ws: dict[str, Any], b):
        ws["sub"] = {}
        for half, op in self.halves.items():
            pre = f"{half[0]}."
            sub = ws["sub"][half] = {k[2:]: v for k, v in ws.items() if k.startswith(pre)}
            op.bind(sub, b)

    @staticmethod
    def _split(p):
        return {h: {k[len(h) + 1 :]: v for k, v in p.items() if k.startswith(h)} for h in _HALVES}

    def _aligned(self, y):
        """The backward half's per-step tensor in timestep order (a reversed view)."""
        return y[:, ::-1] if self.seq else y

    def forward(self, ws: dict[str, Any], x, mask=None, **p):
        ps, sub = self._split(p), ws["sub"]
        yf = self.halves["forward"].forward(sub["forward"], x, mask, **ps["forward"])
        yb = self.halves["backward"].forward(sub["backward"], x, mask, **ps["backward"])
        yb = self._aligned(yb)
        out = ws["out"]
        if self.mode == "concat":
            np.copyto(out[..., : self.uf], yf)
            np.copyto(out[..., self.uf :], yb)
        elif self.mode == "mul":
            np.multiply(yf, yb, out=out)
        else:
            np.add(yf, yb, out=out)
            if self.mode == "ave":
                np.multiply(out, out.dtype.type(0.5), out=out)
        return out

    def backward_local(self, ws: dict[str, Any], dout):
        sub, mode = ws["sub"], self.mode
        if mode == "concat":
            df, db = dout[..., : self.uf], dout[..., self.uf :]
        elif mode == "sum":
            df = db = dout
        elif mode == "ave":
            df = db = np.multiply(dout, dout.dtype.type(0.5), out=ws["d_forward"])
        else:
            yb = self._aligned(sub["backward"]["out"])
            df = np.multiply(dout, yb, out=ws["d_forward"])
            db = np.multiply(dout, sub["forward"]["out"], out=ws["d_backward"])
        ws["douts"] = {"forward": df, "backward": self._aligned(db)}
        for half, op in self.halves.items():
            op.backward_local(sub[half], ws["douts"][half])

    def backward_input(self, ws: dict[str, Any], dout, **p):
        ps, sub, d = self._split(p), ws["sub"], ws["douts"]
        dxf, dxb = (op.backward_input(sub[h], d[h], **ps[h]) for h, op in self.halves.items())
        if self.masked:
            return np.add(dxf[0], dxb[0], out=ws["dx"]), None
        return np.add(dxf, dxb, out=ws["dx"])

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        half, _, own = name.partition("_")
        self.halves[half].backward_weights(ws["sub"][half], ws["douts"][half], own, grad, rows)
