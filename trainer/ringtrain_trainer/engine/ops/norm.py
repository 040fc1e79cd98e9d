"""Keras ``LayerNormalization`` over the last axis: per example and position, no batch
statistics (so, unlike BatchNorm, not batch-coupled and nothing to keep between steps).

Keras computes ``(x - mean) * rsqrt(var + epsilon) * gamma + beta`` with the biased variance;
the op keeps ``xhat`` and ``1 / std`` from forward, and backward is the usual
``(dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std`` on those.

Why products with planned columns: a row is a handful of features (8 in the zoo's transformer),
so numpy's axis reductions (``np.mean`` goes through Python, then an 8-long inner loop) cost
more than the arithmetic; every per-row mean is one product with a column of ``1/d`` and
every per-feature sum (the weight gradients) one with a row of ones, as BatchNorm does.
Backward's two row means come from one product over a ``(n, 2, d)`` pair buffer holding
``dxhat·xhat`` and ``dxhat``, and ``dout·xhat`` is formed once in ``backward_local`` for both
the gamma gradient and ``dxhat·xhat`` (issue 24: 21 numpy calls a step → 16, and none through
Python wrappers).
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.tensor import gamma_beta
from ringtrain_trainer.layers.base import Layer


class LayerNorm(Layer):
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
        bufs.update({"mean": ((n, 1), "f"), "inv": ((n, 1), "f"), "col": ((self.d, 1), "f")})
        if train:
            bufs.update({"ones": ((n,), "f"), "dy_xhat": ((n, self.d), "f")})
            if need_dx:
                bufs.update({"pair": ((n, 2, self.d), "f"), "means": ((n, 2, 1), "f")})
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 8 * b * self.lead * self.d * (1 + 2 * train)

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["col"].fill(1.0 / self.d)

    def forward(self, ws, x, gamma=None, beta=None):
        x2, xhat, mean, inv = x.reshape(-1, self.d), ws["xhat"], ws["mean"], ws["inv"]
        np.matmul(x2, ws["col"], out=mean)
        np.subtract(x2, mean, out=xhat)
        o2 = ws["out"].reshape(-1, self.d)
        np.multiply(xhat, xhat, out=o2)  # the output buffer as scratch for the squares
        np.matmul(o2, ws["col"], out=inv)
        np.add(inv, self.epsilon, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(xhat, inv, out=xhat)
        if gamma is not None:
            np.multiply(xhat, gamma, out=o2)
        else:
            np.copyto(o2, xhat)
        if beta is not None:
            np.add(o2, beta, out=o2)
        return ws["out"]

    def backward_local(self, ws, dout):
        np.multiply(dout.reshape(-1, self.d), ws["xhat"], out=ws["dy_xhat"])

    def backward_input(self, ws, dout, gamma=None, beta=None):
        d2, xhat, pair, means = dout.reshape(-1, self.d), ws["xhat"], ws["pair"], ws["means"]
        prod, dxhat = pair[:, 0], pair[:, 1]
        if gamma is not None:
            np.multiply(d2, gamma, out=dxhat)
            np.multiply(ws["dy_xhat"], gamma, out=prod)  # dxhat · xhat
        else:
            np.copyto(dxhat, d2)
            np.copyto(prod, ws["dy_xhat"])
        # mean(dxhat · xhat) and mean(dxhat) per row, as one 2-D product (not n batched ones)
        np.matmul(pair.reshape(-1, self.d), ws["col"], out=means.reshape(-1, 1))
        dx2 = ws["dx"].reshape(-1, self.d)
        np.multiply(xhat, means[:, 0], out=prod)
        np.subtract(dxhat, prod, out=dx2)
        np.subtract(dx2, means[:, 1], out=dx2)
        np.multiply(dx2, ws["inv"], out=dx2)
        return ws["dx"]

    def backward_weights(self, ws, dout, name, grad, rows):
        src = dout.reshape(-1, self.d) if name == "beta" else ws["dy_xhat"]
        np.matmul(ws["ones"], src, out=grad)
