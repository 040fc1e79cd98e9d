"""BatchNormalization over the channel axis; the statistics rule is in the package docstring."""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer


class BatchNorm(Layer):
    """BatchNormalization over the last axis (see the module docstring for the statistics)."""

    batch_coupled = True

    def __init__(self, shape, momentum, epsilon, center, scale):
        self.in_shape = self.out_shape = tuple(shape)
        self.c = shape[-1]
        self.momentum, self.eps, self.center, self.scale = momentum, epsilon, center, scale

    def params(self, layer):
        ps = []
        if self.scale:
            ps.append(ParamSpec(layer, "gamma", (self.c,), 0, 0, False, ones=True))
        if self.center:
            ps.append(ParamSpec(layer, "beta", (self.c,), 0, 0, False))
        return ps

    def state_specs(self):
        return [("moving_mean", self.c, 0.0), ("moving_variance", self.c, 1.0)]

    def buffers(self, b, train, need_dx):
        shape = (b, *self.out_shape)
        bufs = {"out": (shape, "f"), "inv": ((self.c,), "f"), "mean": ((self.c,), "f")}
        if train:
            bufs.update(
                {
                    "xhat": (shape, "f"),
                    "dxhat": (shape, "f"),
                    "var": ((self.c,), "f"),
                    "s1": ((self.c,), "f"),
                    "s2": ((self.c,), "f"),
                }
            )
            if need_dx:
                bufs["dx"] = (shape, "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (4 + 8 * train)

    def forward(self, ws, x, gamma=None, beta=None):
        out, inv, mean = ws["out"], ws["inv"], ws["mean"]
        axes = tuple(range(x.ndim - 1))
        if "xhat" in ws:
            var = ws["var"]
            np.mean(x, axis=axes, out=mean)
            np.subtract(x, mean, out=out)
            xc = ws["xhat"]
            np.multiply(out, out, out=xc)
            np.mean(xc, axis=axes, out=var)
            m = out.dtype.type(self.momentum)
            for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                mv = ws[name]
                mv *= m
                mv += (1 - m) * batch
            np.add(var, self.eps, out=inv)
        else:
            np.copyto(mean, ws["moving_mean"])
            np.subtract(x, mean, out=out)
            np.add(ws["moving_variance"], self.eps, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(out, inv, out=out)
        if "xhat" in ws:
            np.copyto(ws["xhat"], out)
        if gamma is not None:
            np.multiply(out, gamma, out=out)
        if beta is not None:
            np.add(out, beta, out=out)
        return out

    def backward_weights(self, ws, dout, name, grad, rows):
        xhat = ws["xhat"]
        dy = dout.reshape(xhat.shape)
        axes = tuple(range(dy.ndim - 1))
        if name == "beta":
            np.sum(dy, axis=axes, out=grad)
        else:  # gamma
            np.multiply(dy, xhat, out=ws["dxhat"])
            np.sum(ws["dxhat"], axis=axes, out=grad)

    def backward_inference(self, ws, dout, gamma=None, beta=None):
        """The input gradient of the inference-mode forward (``engine.ops.frozen``): the
        moving statistics are constants, so ``dx = dy * gamma / sqrt(moving_var + eps)``."""
        dx = ws["dx"]
        np.multiply(dout.reshape(dx.shape), ws["inv"], out=dx)
        if gamma is not None:
            np.multiply(dx, gamma, out=dx)
        return dx

    def backward_input(self, ws, dout, gamma=None, beta=None):
        xhat, dxhat = ws["xhat"], ws["dxhat"]
        dy = dout.reshape(xhat.shape)
        axes = tuple(range(dy.ndim - 1))
        n = dy.size // self.c
        if gamma is not None:
            np.multiply(dy, gamma, out=dxhat)
        else:
            np.copyto(dxhat, dy)
        s1, s2, dx = ws["s1"], ws["s2"], ws["dx"]
        np.sum(dxhat, axis=axes, out=s1)
        np.multiply(dxhat, xhat, out=dx)
        np.sum(dx, axis=axes, out=s2)
        # dx = inv * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        s1 /= n
        s2 /= n
        np.multiply(xhat, s2, out=dx)
        np.add(dx, s1, out=dx)
        np.subtract(dxhat, dx, out=dx)
        np.multiply(dx, ws["inv"], out=dx)
        return dx
