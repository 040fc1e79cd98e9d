"""Keras ``GroupNormalization`` on the channels (last) axis: the ``c`` channels split into
``groups`` groups of ``c / groups``; each example's group is normalized over its channels and
all spatial positions together — LayerNormalization over a group instead of one position's
features. Per example: no batch statistics, nothing kept between steps.

Keras computes ``(x - mean) * rsqrt(var + epsilon) * gamma + beta`` with the biased variance
per (example, group); the op keeps ``xhat`` and ``1 / std`` from forward, and backward is
LayerNormalization's ``(dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std`` with the
means over each group's ``(positions, channels of the group)``.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import gamma_beta

_AXES = (1, 3)  # of the (b, positions, groups, channels per group) view


class GroupNormWs(TypedDict, total=False):
    """The buffers :class:`GroupNorm` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    dxhat: np.ndarray
    inv: np.ndarray
    mean: np.ndarray
    out: np.ndarray
    tmp: np.ndarray
    xhat: np.ndarray


class GroupNorm(Op):
    """Normalise ``(b, *spatial, c)`` per example over each group of ``c // groups``
    channels and every position; ``scale`` (gamma) and ``center`` (beta) per channel."""

    kind = "group_norm"

    def __init__(self, shape, groups: int, epsilon=1e-3, center: bool = True, scale=True):
        self.in_shape = self.out_shape = tuple(shape)
        self.c = self.in_shape[-1]
        if groups < 1 or self.c % groups:
            raise ValueError(f"{self.c} channels do not split into {groups} groups")
        self.g, self.cg = groups, self.c // groups
        self.s = math.prod(self.in_shape[:-1])
        self.epsilon, self.center, self.scale = epsilon, center, scale

    def params(self, layer):
        return gamma_beta(layer, self.c, self.scale, self.center)

    def _view(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(-1, self.s, self.g, self.cg)

    def buffers(self, b, train, need_dx):
        grid = (b, self.s, self.g, self.cg)
        bufs = self.out_and_dx(b, train, need_dx)
        bufs.update({"xhat": (grid, "f"), "mean": ((b, 1, self.g, 1), "f")})
        bufs["inv"] = ((b, 1, self.g, 1), "f")
        if train:
            bufs.update({"dxhat": (grid, "f"), "tmp": (grid, "f")})
        return bufs

    def flops(self, b, train, need_dx):
        return 8 * b * self.s * self.c * (1 + 2 * train)

    def forward(self, ws: GroupNormWs, x, gamma=None, beta=None):
        x4, xhat, mean, inv = self._view(x), ws["xhat"], ws["mean"], ws["inv"]
        np.mean(x4, axis=_AXES, keepdims=True, out=mean)
        np.subtract(x4, mean, out=xhat)
        sq = self._view(ws["out"])  # scratch: written with the result below
        np.square(xhat, out=sq)
        np.mean(sq, axis=_AXES, keepdims=True, out=inv)
        np.add(inv, self.epsilon, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(xhat, inv, out=xhat)
        out = ws["out"]
        o4 = self._view(out)
        if gamma is not None:
            np.multiply(xhat, gamma.reshape(self.g, self.cg), out=o4)
        else:
            np.copyto(o4, xhat)
        if beta is not None:
            np.add(o4, beta.reshape(self.g, self.cg), out=o4)
        return out

    def backward_input(self, ws: GroupNormWs, dout, gamma=None, beta=None):
        d4, xhat, dxhat, tmp = self._view(dout), ws["xhat"], ws["dxhat"], ws["tmp"]
        mean = ws["mean"]  # forward's mean is no longer needed: reused as a workspace
        if gamma is not None:
            np.multiply(d4, gamma.reshape(self.g, self.cg), out=dxhat)
        else:
            np.copyto(dxhat, d4)
        dx4 = self._view(ws["dx"])
        np.multiply(dxhat, xhat, out=tmp)
        np.mean(tmp, axis=_AXES, keepdims=True, out=mean)
        np.multiply(xhat, mean, out=tmp)
        np.mean(dxhat, axis=_AXES, keepdims=True, out=mean)
        np.subtract(dxhat, mean, out=dx4)
        np.subtract(dx4, tmp, out=dx4)
        np.multiply(dx4, ws["inv"], out=dx4)
        return ws["dx"]

    def backward_weights(self, ws: GroupNormWs, dout, name, grad, rows):
        d2 = dout.reshape(-1, self.c)
        if name == "beta":
            np.sum(d2, axis=0, out=grad.reshape(self.c))
        else:
            tmp = ws["tmp"].reshape(-1, self.c)
            np.multiply(d2, ws["xhat"].reshape(-1, self.c), out=tmp)
            np.sum(tmp, axis=0, out=grad.reshape(self.c))
