"""BatchNormalization over the channel axis.

BatchNormalization normalises with the statistics of each *replica's* batch in training, as
Keras does under MirroredStrategy without ``synchronized=True``; a replica's batch is never split
across host threads (the IPU runs it as one shard), so host threads do not change the numbers.
The moving mean and variance are non-trainable state, outside the flat parameter buffer and the
ring: each replica updates its copy, and after every step the worker's copies are averaged (how
Keras reads an ``ON_READ``/``MEAN`` variable). Workers keep their own; the chief's is what
checkpoints and exports carry.

Every per-channel sum is one BLAS product with a planned vector of ones over the ``(rows, c)``
view: numpy's axis reductions run an inner loop of ``c`` floats (4 in the zoo's BN CNN) and
were 25 % of its step (py-spy, issue 24). Backward is fused: ``backward_local`` forms the two
sums both halves need (``Σ dy``, ``Σ dy·x̂``) once; the input gradient is then
``dy·a + x̂·b + c`` with per-channel ``a, b, c``.

Few channels: numpy broadcasts a ``(c,)`` vector over ``(rows, c)`` with an inner loop of ``c``
elements, so with 4 channels each elementwise pass ran ~9,000 inner loops for 37k values, and BN
was half of the zoo's BN CNN's step (issue 39). Every broadcast pass runs instead on the
``(rows / k, k·c)`` view with the vector tiled ``k`` times (``k·c`` about :data:`FOLD_WIDTH`,
``k`` dividing ``rows``): the same operations on the same elements, so the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import gamma_beta

#: the row width broadcast passes aim for (numpy's inner loop): k * c <= this
FOLD_WIDTH = 256


def fold(rows: int, c: int, width: int | None = None) -> int:
    """The largest ``k`` dividing ``rows`` with ``k * c <= width`` (default
    :data:`FOLD_WIDTH`; 1: no fold)."""
    width = FOLD_WIDTH if width is None else width
    return max(k for k in range(1, max(1, width // c) + 1) if rows % k == 0)


class BatchNorm(Op):
    """BatchNormalization over the last axis (see the module docstring for the statistics)."""

    batch_coupled = True

    def __init__(self, shape, momentum, epsilon, center, scale):
        self.in_shape = self.out_shape = tuple(shape)
        self.c = shape[-1]
        self.momentum, self.eps, self.center, self.scale = momentum, epsilon, center, scale

    def params(self, layer):
        return gamma_beta(layer, self.c, self.scale, self.center)

    def state_specs(self):
        return [("moving_mean", self.c, 0.0), ("moving_variance", self.c, 1.0)]

    def buffers(self, b, train, need_dx):
        shape = (b, *self.out_shape)
        wide = fold(b * math.prod(shape[1:-1]), self.c) * self.c
        bufs = {"out": (shape, "f"), "inv": ((self.c,), "f"), "mean": ((self.c,), "f")}
        #: the per-channel vectors tiled to the folded row: mean, inv, gamma, beta, a, b, c
        bufs["tiled"] = ((7, wide), "f")
        if train:
            bufs.update(
                {
                    "xhat": (shape, "f"),
                    "dxhat": (shape, "f"),
                    "var": ((self.c,), "f"),
                    "s1": ((self.c,), "f"),
                    "s2": ((self.c,), "f"),
                    "coef": ((3, self.c), "f"),
                    "ones": ((shape[0] * math.prod(shape[1:-1]),), "f"),
                }
            )
            if need_dx:
                bufs["dx"] = (shape, "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (4 + 8 * train)

    def bind(self, ws: dict[str, Any], b):
        if "ones" in ws:
            ws["ones"].fill(1)
        # from this batch's rows, within the planned width (a program may bind a smaller batch)
        ws["rows"] = rows = b * math.prod(self.out_shape[:-1])
        ws["k"] = fold(rows, self.c, ws["tiled"].shape[1])

    def _wide(self, ws: dict[str, Any], a):
        """``a`` (any shape, ``rows * c`` values) as the folded ``(rows / k, k * c)`` view."""
        return a.reshape(ws["rows"] // ws["k"], ws["k"] * self.c)

    def _tiled(self, ws: dict[str, Any], i: int, vec):
        """Row ``i`` of the tiled vectors, ``vec`` (``(c,)``) repeated ``k`` times."""
        t = ws["tiled"][i, : ws["k"] * self.c]
        np.copyto(t.reshape(ws["k"], self.c), vec)
        return t

    def _mean(self, ws: dict[str, Any], a, out):
        """``out = a``'s mean over every axis but the channels, as one product."""
        ones = ws["ones"]
        np.matmul(ones, a.reshape(ones.size, self.c), out=out)
        np.divide(out, ones.size, out=out)

    def forward(self, ws: dict[str, Any], x, gamma=None, beta=None):
        out, inv, mean = ws["out"], ws["inv"], ws["mean"]
        wo, wx = self._wide(ws, out), self._wide(ws, x)
        if "xhat" in ws:
            var = ws["var"]
            self._mean(ws, x, mean)
            np.subtract(wx, self._tiled(ws, 0, mean), out=wo)
            xc = ws["xhat"]
            np.multiply(out, out, out=xc)
            self._mean(ws, xc, var)
            m = out.dtype.type(self.momentum)
            for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                mv = ws[name]
                mv *= m
                mv += (1 - m) * batch
            np.add(var, self.eps, out=inv)
        else:
            np.copyto(mean, ws["moving_mean"])
            np.subtract(wx, self._tiled(ws, 0, mean), out=wo)
            np.add(ws["moving_variance"], self.eps, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(wo, self._tiled(ws, 1, inv), out=wo)
        if "xhat" in ws:
            np.copyto(ws["xhat"], out)
        if gamma is not None:
            np.multiply(wo, self._tiled(ws, 2, gamma), out=wo)
        if beta is not None:
            np.add(wo, self._tiled(ws, 3, beta), out=wo)
        return out

    def backward_local(self, ws: dict[str, Any], dout):
        xhat, ones, s1, s2 = ws["xhat"], ws["ones"], ws["s1"], ws["s2"]
        dy = dout.reshape(ones.size, self.c)
        np.matmul(ones, dy, out=s1)  # Σ dy: beta's gradient
        np.multiply(dy, xhat.reshape(dy.shape), out=ws["dxhat"].reshape(dy.shape))
        np.matmul(ones, ws["dxhat"].reshape(dy.shape), out=s2)  # Σ dy·x̂: gamma's

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        np.copyto(grad, ws["s1"] if name == "beta" else ws["s2"])

    def backward_inference(self, ws: dict[str, Any], dout, gamma=None, beta=None):
        """The input gradient of the inference-mode forward (``engine.ops.frozen``): the
        moving statistics are constants, so ``dx = dy * gamma / sqrt(moving_var + eps)``."""
        dx = ws["dx"]
        wdx = self._wide(ws, dx)
        np.multiply(self._wide(ws, dout), self._tiled(ws, 1, ws["inv"]), out=wdx)
        if gamma is not None:
            np.multiply(wdx, self._tiled(ws, 2, gamma), out=wdx)
        return dx

    def backward_input(self, ws: dict[str, Any], dout, gamma=None, beta=None):
        # dx = inv·γ·(dy − Σdy/n − x̂·Σ(dy·x̂)/n) = dy·a + x̂·b + c
        xhat, tmp, dx, coef = ws["xhat"], ws["dxhat"], ws["dx"], ws["coef"]
        a, b, c = coef
        n = ws["ones"].size
        np.copyto(a, ws["inv"])
        if gamma is not None:
            np.multiply(a, gamma, out=a)
        np.divide(a, -n, out=c)
        np.multiply(c, ws["s2"], out=b)
        np.multiply(c, ws["s1"], out=c)
        wdx, wtmp = self._wide(ws, dx), self._wide(ws, tmp)
        np.multiply(self._wide(ws, dout), self._tiled(ws, 4, a), out=wdx)
        np.multiply(self._wide(ws, xhat), self._tiled(ws, 5, b), out=wtmp)
        np.add(wdx, wtmp, out=wdx)
        np.add(wdx, self._tiled(ws, 6, c), out=wdx)
        return dx
