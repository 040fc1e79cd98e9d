"""Keras ``Normalization``: ``(x - mean) / max(sqrt(variance), 1e-7)`` per channel, with fixed
statistics — EfficientNet and ConvNeXt open with one.

The statistics are either constants of the config (``mean=[...]``, ``variance=[...]``) or the
layer's non-trainable weights (``mean``, ``variance``, ``count``, set by ``adapt`` before the
model was saved), which live in the model's state like BatchNormalization's moving statistics:
they travel with checkpoints and exports and never change in training (Keras' ``fit`` does not
adapt). ``count`` is carried only so the export holds every weight Keras expects.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

#: Keras' ``backend.epsilon()``: the smallest standard deviation divided by
EPSILON = 1e-7


class StandardizeWs(TypedDict, total=False):
    """The buffers :class:`Standardize` is compiled with (``buffers``, its state, ``bind``)."""

    count: np.ndarray
    dx: np.ndarray
    inv: np.ndarray
    mean: np.ndarray
    out: np.ndarray
    variance: np.ndarray


class Standardize(Op):
    """Per-channel ``(x - mean) * (1 / max(sqrt(variance), 1e-7))`` over the last axis."""

    def __init__(self, shape, mean=None, variance=None):
        self.in_shape = self.out_shape = tuple(shape)
        self.c = self.in_shape[-1]
        self.fixed = mean is not None
        if self.fixed:
            self.mean = np.broadcast_to(np.asarray(mean, np.float32), (self.c,)).copy()
            self.var = np.broadcast_to(np.asarray(variance, np.float32), (self.c,)).copy()

    def state_specs(self):
        if self.fixed:
            return []
        return [("mean", self.c, 0.0), ("variance", self.c, 1.0), ("count", 1, 0.0)]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f"), "inv": ((self.c,), "f")}
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (2 + train)

    def forward(self, ws: StandardizeWs, x):
        mean, var = (self.mean, self.var) if self.fixed else (ws["mean"], ws["variance"])
        inv = ws["inv"]
        np.sqrt(var, out=inv)
        np.maximum(inv, inv.dtype.type(EPSILON), out=inv)
        np.reciprocal(inv, out=inv)
        out = ws["out"]
        np.subtract(x, mean, out=out)
        np.multiply(out, inv, out=out)
        return out

    def backward_input(self, ws: StandardizeWs, dout):
        return np.multiply(dout.reshape(ws["dx"].shape), ws["inv"], out=ws["dx"])
