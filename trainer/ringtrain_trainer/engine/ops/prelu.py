"""Keras ``PReLU``: ``max(x, 0) + alpha * min(x, 0)`` with a trainable ``alpha`` per position
of the input, shared (size 1) along ``shared_axes``. Keras computes it as
``relu(x) - alpha * relu(-x)``, so at ``x == 0`` both slopes' gradients are 0, as here."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import ParamSpec


class PReLUWs(TypedDict, total=False):
    """The buffers :class:`PReLU` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    m: np.ndarray
    neg: np.ndarray
    out: np.ndarray
    x: np.ndarray


class PReLU(Op):
    def __init__(self, shape, alpha_shape):
        self.in_shape = self.out_shape = tuple(shape)
        self.alpha_shape = tuple(alpha_shape)
        if len(self.alpha_shape) != len(self.in_shape):
            raise ValueError(f"alpha {self.alpha_shape} does not match input {self.in_shape}")
        #: the batch axis and the shared axes: summed in alpha's gradient
        self.sum_axes = (0, *(i + 1 for i, n in enumerate(self.alpha_shape) if n == 1))

    def params(self, layer):
        return [ParamSpec(layer, "alpha", self.alpha_shape, 0, 0, False)]

    def buffers(self, b, train, need_dx):
        bufs = {**self.out_and_dx(b, train, need_dx), "m": ((b, *self.in_shape), "f")}
        if train:
            bufs["neg"] = ((b, *self.in_shape), "f")
        return bufs

    def forward(self, ws: PReLUWs, x, alpha):
        x = x.reshape(ws["out"].shape)
        ws["x"] = x
        out, m = ws["out"], ws["m"]
        neg = ws.get("neg", m)
        np.minimum(x, 0, out=neg)  # kept for alpha's gradient
        np.multiply(neg, alpha, out=out)
        np.maximum(x, 0, out=m)
        np.add(out, m, out=out)
        return out

    def backward_input(self, ws: PReLUWs, dout, alpha):
        dout = dout.reshape(ws["out"].shape)
        x, dx, m = ws["x"], ws["dx"], ws["m"]
        np.greater(x, 0, out=m)
        np.multiply(dout, m, out=dx)
        np.less(x, 0, out=m)
        np.multiply(m, alpha, out=m)
        np.multiply(m, dout, out=m)
        np.add(dx, m, out=dx)
        return dx

    def backward_weights(self, ws: PReLUWs, dout, name, grad, rows):
        m = ws["m"]
        np.multiply(dout.reshape(m.shape), ws["neg"], out=m)
        np.sum(m, axis=self.sum_axes, keepdims=True, out=grad.reshape(1, *self.alpha_shape))
