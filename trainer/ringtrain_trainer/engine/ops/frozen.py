"""A frozen layer (Keras ``trainable=False``): any op whose parameters are held as state.

Why a wrapper and not a flag in every op: freezing changes where the weights live, not the
arithmetic. The wrapped op's parameters leave the flat parameter buffer and become its
non-trainable state (``ModelSpec.state_specs``), so nothing downstream needs a rule of its own:
they get no gradient piece, the reducer never sends them over the ring and the optimizer never
sees them — as PyTorch DDP skips parameters with ``requires_grad=False`` — while checkpoints
and exports keep them with the rest of the state. Backward still runs the op's input gradient
(the layers above a frozen base, or a frozen layer between trained ones, need it), and not at
all when the op reads only the data.

``inference``: Keras 3 runs a frozen ``BatchNormalization`` in inference mode even in training
(``training and self.trainable``): it normalizes with the moving statistics and does not update
them. The wrapped op's evaluation buffers are used, and its ``backward_inference`` gives the
input gradient of that affine map.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op


class Frozen(Op):
    """``op`` with its parameters as state; ``inference``: its evaluation forward in training
    too (a frozen BatchNormalization)."""

    def __init__(self, op, inference: bool = False):
        self.op, self.inference = op, inference
        #: the wrapped op's parameters, now state (same names, Keras' initial value flags)
        self.frozen = op.params(0)
        self.in_shape = op.in_shape
        self.out_shape = op.out_shape
        self.kind = op.kind
        self.batch_coupled = op.batch_coupled and not inference
        if hasattr(op, "n_inputs"):
            self.n_inputs = op.n_inputs
        if hasattr(op, "in_shapes"):
            self.in_shapes = op.in_shapes

    @property
    def frozen_size(self) -> int:
        """How many parameters this op holds frozen (the start-up log and memory report)."""
        return sum(p.size for p in self.frozen)

    def state_specs(self):
        own = [(p.name, p.size, 1.0 if p.ones else 0.0) for p in self.frozen]
        return own + self.op.state_specs()

    def buffers(self, b, train, need_dx):
        if not self.inference:
            return self.op.buffers(b, train, need_dx)
        bufs = dict(self.op.buffers(b, False, need_dx))
        if train and need_dx:
            bufs["dx"] = ((b, *self.op.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return self.op.flops(b, train and not self.inference, need_dx)

    def bind(self, ws: dict[str, Any], b):
        self.op.bind(ws, b)

    def _params(self, ws: dict[str, Any]) -> dict[str, np.ndarray]:
        return {p.name: ws[p.name].reshape(p.shape) for p in self.frozen}

    def forward(self, ws: dict[str, Any], *xs):
        return self.op.forward(ws, *xs, **self._params(ws))

    def backward_local(self, ws: dict[str, Any], dout):
        if not self.inference:
            self.op.backward_local(ws, dout)

    def backward_input(self, ws: dict[str, Any], dout):
        if self.inference:
            return self.op.backward_inference(ws, dout, **self._params(ws))
        return self.op.backward_input(ws, dout, **self._params(ws))
