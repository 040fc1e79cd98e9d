"""A per-channel affine map ``x * scale + offset`` on the last axis: Keras ``Rescaling`` with a
scale/offset per channel (fixed), and keras.applications ConvNeXt's ``LayerScale`` (a trainable
``gamma`` per channel, no offset). One op because the arithmetic and its gradient are one; the
trainable case differs only in where ``scale`` comes from (a parameter, not the config)."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import ParamSpec


class ChannelScaleWs(TypedDict, total=False):
    """The buffers :class:`ChannelScale` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    offset: np.ndarray
    out: np.ndarray
    prod: np.ndarray
    scale: np.ndarray
    x: np.ndarray


class ChannelScale(Op):
    """``x * scale + offset`` broadcast along the last axis; ``scale=None``: a trainable
    ``gamma`` of one value per channel (its gradient: ``sum(dout * x)`` over all but it)."""

    def __init__(self, shape, scale=None, offset=0.0):
        self.in_shape = self.out_shape = tuple(shape)
        c = self.in_shape[-1]
        self.trained = scale is None
        self.scale = None if scale is None else np.broadcast_to(np.asarray(scale), (c,)).copy()
        self.offset = np.broadcast_to(np.asarray(offset), (c,)).copy()
        self.has_offset = bool(np.any(self.offset != 0))

    def params(self, layer):
        c = self.in_shape[-1]
        return [ParamSpec(layer, "gamma", (c,), 0, 0, False)] if self.trained else []

    def buffers(self, b, train, need_dx):
        bufs = self.out_and_dx(b, train, need_dx)
        if train and self.trained:
            bufs["prod"] = ((b, *self.in_shape), "f")
        return bufs

    def bind(self, ws: ChannelScaleWs, b):
        dt = ws["out"].dtype
        if self.scale is not None:  # else gamma is trained and passed to every call
            ws["scale"] = self.scale.astype(dt)
        ws["offset"] = self.offset.astype(dt)

    def forward(self, ws: ChannelScaleWs, x, gamma=None):
        ws["x"] = x
        out = ws["out"]
        np.multiply(x, ws["scale"] if gamma is None else gamma, out=out)
        if self.has_offset:
            np.add(out, ws["offset"], out=out)
        return out

    def backward_input(self, ws: ChannelScaleWs, dout, gamma=None):
        dx = ws["dx"]
        return np.multiply(dout.reshape(dx.shape), ws["scale"] if gamma is None else gamma, out=dx)

    def backward_weights(self, ws: ChannelScaleWs, dout, name, grad, rows):
        prod = ws["prod"]
        np.multiply(dout.reshape(prod.shape), ws["x"], out=prod)
        c = self.in_shape[-1]
        np.sum(prod.reshape(-1, c), axis=0, out=grad.reshape(c))
