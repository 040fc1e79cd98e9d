"""Keras ``TimeDistributed``: one op applied to every step of a sequence.

Keras calls the wrapped layer once per timestep; for a layer whose every example is computed
alone (no batch statistics, no randomness: the registry entry refuses the others) that is the
same arithmetic as one call on the ``(batch * steps, ...)`` tensor, which a C-contiguous
``(batch, steps, ...)`` buffer already is. So the wrapped op runs unchanged on reshaped views
and plans its own buffers for ``batch * steps`` examples: no copy, no op of its own to get wrong.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op


class TimeDistributedWs(TypedDict, total=False):
    """The buffers :class:`TimeDistributed` is compiled with (``buffers``, its state, ``bind``)."""


class TimeDistributed(Op):
    """``inner`` (any op of the layer protocol) over axis 1 of ``(b, steps, *inner_in)``."""

    def __init__(self, inner, steps: int, inner_in, inner_out):
        self.inner, self.steps = inner, int(steps)
        self.in_shape = (self.steps, *inner_in)
        self.out_shape = (self.steps, *inner_out)
        self._in, self._out = tuple(inner_in), tuple(inner_out)
        self.kind = getattr(inner, "kind", "layer")
        self.batch_coupled = getattr(inner, "batch_coupled", False)

    def params(self, layer):
        return self.inner.params(layer)

    def state_specs(self):
        return self.inner.state_specs()

    def buffers(self, b, train, need_dx):
        return self.inner.buffers(b * self.steps, train, need_dx)

    def flops(self, b, train, need_dx):
        return self.inner.flops(b * self.steps, train, need_dx)

    def bind(self, ws: TimeDistributedWs, b):
        self.inner.bind(ws, b * self.steps)

    def _flat(self, a: np.ndarray, shape) -> np.ndarray:
        return a.reshape(-1, *shape)

    def forward(self, ws: TimeDistributedWs, x, **p):
        y = self.inner.forward(ws, self._flat(x, self._in), **p)
        return y.reshape(-1, *self.out_shape)

    def backward_local(self, ws: TimeDistributedWs, dout):
        self.inner.backward_local(ws, self._flat(dout, self._out))

    def backward_input(self, ws: TimeDistributedWs, dout, **p):
        dx = self.inner.backward_input(ws, self._flat(dout, self._out), **p)
        return dx.reshape(-1, *self.in_shape)

    def backward_weights(self, ws: TimeDistributedWs, dout, name, grad, rows):
        self.inner.backward_weights(ws, self._flat(dout, self._out), name, grad, rows)
