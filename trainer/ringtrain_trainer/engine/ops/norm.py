"""Keras ``LayerNormalization`` over the last axis: per example and position, no batch
statistics (so, unlike BatchNorm, not batch-coupled and nothing to keep between steps).

Keras computes ``(x - mean) * rsqrt(var + epsilon) * gamma + beta`` with the biased variance;
the op keeps ``xhat`` and ``1 / std`` from forward, and backward is the usual
``(dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std`` on those.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import gamma_beta


class LayerNormWs(TypedDict, total=False):
    """The buffers :class:`LayerNorm` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    dxhat: np.ndarray
    inv: np.ndarray
    mean: np.ndarray
    ones: np.ndarray
    out: np.ndarray
    tmp: np.ndarray
    xhat: np.ndarray


class LayerNorm(Op):
    """Normalise ``(b, *lead, d)`` over ``d``; ``scale`` (gamma) and ``center`` (beta)."""

    kind = "layer_norm"

    def __init__(self, shape, epsilon: float = 1e-3, center: bool = True, scale: bool = True):
        self.in_shape = self.out_shape = tuple(shape)
        self.d, self.lead = self.in_shape[-1], math.prod(self.in_shape[:-1])
        self.epsilon, self.center, self.scale = epsilon, center, scale

    def params(self, layer):
        return gamma_beta(layer, self.d, self.scale, self.center)

    def buffers(self, b, train, need_dx):
        n = b * self.lead
        bufs = {"out": ((b, *self.out_shape), "f"), "xhat": ((n, self.d), "f")}
        bufs.update({"mean": ((n, 1), "f"), "inv": ((n, 1), "f")})
        if train:
            bufs.update({"ones": ((n,), "f"), "dxhat": ((n, self.d), "f")})
            bufs["tmp"] = ((n, self.d), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 8 * b * self.lead * self.d * (1 + 2 * train)

    def bind(self, ws: LayerNormWs, b):
        if "ones" in ws:
            ws["ones"].fill(1)

    def forward(self, ws: LayerNormWs, x, gamma=None, beta=None):
        x2, xhat, mean, inv = x.reshape(-1, self.d), ws["xhat"], ws["mean"], ws["inv"]
        np.mean(x2, axis=1, keepdims=True, out=mean)
        np.subtract(x2, mean, out=xhat)
        np.einsum("ij,ij->i", xhat, xhat, out=inv[:, 0])
        np.multiply(inv, 1.0 / self.d, out=inv)
        np.add(inv, self.epsilon, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(xhat, inv, out=xhat)
        out = ws["out"]
        o2 = out.reshape(-1, self.d)
        if gamma is not None:
            np.multiply(xhat, gamma, out=o2)
        else:
            np.copyto(o2, xhat)
        if beta is not None:
            np.add(o2, beta, out=o2)
        return out

    def backward_local(self, ws: LayerNormWs, dout):
        pass

    def backward_input(self, ws: LayerNormWs, dout, gamma=None, beta=None):
        d2, xhat, dxhat, tmp = dout.reshape(-1, self.d), ws["xhat"], ws["dxhat"], ws["tmp"]
        mean = ws["mean"]  # forward's mean is no longer needed: reused as a (n, 1) workspace
        if gamma is not None:
            np.multiply(d2, gamma, out=dxhat)
        else:
            np.copyto(dxhat, d2)
        dx = ws["dx"]
        dx2 = dx.reshape(-1, self.d)
        np.einsum("ij,ij->i", dxhat, xhat, out=mean[:, 0])
        np.multiply(mean, 1.0 / self.d, out=mean)
        np.multiply(xhat, mean, out=tmp)
        np.mean(dxhat, axis=1, keepdims=True, out=mean)
        np.subtract(dxhat, mean, out=dx2)
        np.subtract(dx2, tmp, out=dx2)
        np.multiply(dx2, ws["inv"], out=dx2)
        return dx

    def backward_weights(self, ws: LayerNormWs, dout, name, grad, rows):
        d2 = dout.reshape(-1, self.d)
        if name == "beta":
            np.matmul(ws["ones"], d2, out=grad)
        else:
            np.multiply(d2, ws["xhat"], out=ws["tmp"])
            np.matmul(ws["ones"], ws["tmp"], out=grad)
