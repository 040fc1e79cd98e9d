"""A shared layer (one layer called on several tensors): one op per call, one set of weights.

Why two wrappers: each call is its own node (its own activations, its own input gradient), but
the weights exist once, in the slots of one call — the *owner*, the call that runs last in
backward (first in forward), so by the time it streams a gradient piece every other call has
contributed. The other calls (:class:`Tied`) own no parameters; ``ModelSpec.ties`` gives them
the owner's parameter views, and in their backward they compute their whole weight gradients
and add them into the owner's planned accumulator (the Program links the owner's workspace as
``ws["owner"]``). The owner (:class:`Shared`) adds that accumulator into each piece it writes
and clears those rows, so the streamed piece is the sum over every call — the rule for a
fanned-out tensor's gradient, applied to weights — and the reducer and optimizer see one
parameter, as in Keras. Nothing allocates per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op


def _rows(a: np.ndarray) -> np.ndarray:
    """The parameter's matrix view the piece grid counts rows on."""
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


class _Wrapped(Op):
    def __init__(self, op):
        self.op = op
        self.shared = op.params(0)
        self.in_shape = op.in_shape
        self.out_shape = op.out_shape
        self.kind, self.batch_coupled, self.name = op.kind, op.batch_coupled, op.name
        for attr in ("n_inputs", "in_shapes", "n_in", "chunk"):
            if hasattr(op, attr):
                setattr(self, attr, getattr(op, attr))

    def state_specs(self):
        return self.op.state_specs()

    def flops(self, b, train, need_dx):
        return self.op.flops(b, train, need_dx)

    def bind(self, ws: dict[str, Any], b):
        self.op.bind(ws, b)

    def forward(self, ws: dict[str, Any], *xs, **params):
        return self.op.forward(ws, *xs, **params)

    def backward_input(self, ws: dict[str, Any], dout, **params):
        return self.op.backward_input(ws, dout, **params)


class Shared(_Wrapped):
    """The owning call: its parameters are the layer's; each piece gets the other calls'."""

    def params(self, layer):
        return self.op.params(layer)

    def buffers(self, b, train, need_dx):
        bufs = dict(self.op.buffers(b, train, need_dx))
        if train:
            bufs.update({f"shared_{p.name}": (p.shape, "f") for p in self.shared})
        return bufs

    def backward_local(self, ws: dict[str, Any], dout):
        self.op.backward_local(ws, dout)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        self.op.backward_weights(ws, dout, name, grad, rows)
        lo, hi = rows
        g, acc = _rows(grad)[lo:hi], _rows(ws[f"shared_{name}"])[lo:hi]
        np.add(g, acc, out=g)
        acc.fill(0)


class Tied(_Wrapped):
    """A later call: the owner's parameters; its weight gradients go to the owner's
    accumulator."""

    def buffers(self, b, train, need_dx):
        bufs = dict(self.op.buffers(b, train, need_dx))
        if train:
            bufs.update({f"tied_{p.name}": (p.shape, "f") for p in self.shared})
        return bufs

    def backward_local(self, ws: dict[str, Any], dout):
        self.op.backward_local(ws, dout)
        owner = ws["owner"]
        for p in self.shared:
            mine = ws[f"tied_{p.name}"]
            self.op.backward_weights(ws, dout, p.name, mine, (0, p.rows))
            acc = owner[f"shared_{p.name}"]
            np.add(acc, mine, out=acc)
