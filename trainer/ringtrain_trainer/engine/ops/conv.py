"""Conv1D and Conv2D with any kernel, strides, dilation and padding (``valid``, ``same``, and
``causal`` for 1-D): im2col as a strided view copied into one planned buffer, then one BLAS
product forward, one per weight row block, and one batched product for the input gradient.

The input gradient is computed per kernel tap (``dz @ kernel[i, j].T``, one batched product
into a ``(taps, rows, cin)`` buffer), not as one ``(rows, kh*kw*cin)`` matrix scattered back
(col2im): each tap's block is then contiguous and adds onto the padded input gradient with
whole image rows as the inner loop, where col2im's inner loop was ``cin`` floats at a stride of
``kh*kw*cin``. py-spy on the zoo's ``resnet_add`` (3x3 ``same``, 6 channels): col2im was 47 %
of the step; the scatter 4.0 -> 1.2 ms at its shape, 90 -> 63 ms at 26x26x32->64 (one core).

A 1x1 convolution with unit strides and no padding (MobileNet's pointwise layers) skips
im2col: the input already is the column matrix."""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.engine.ops.window import Window
from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer


class Conv(Window, Layer):
    """Keras ``Conv1D`` (input ``(steps, channels)``, kernel ``(k, cin, filters)``) and
    ``Conv2D`` (input ``(h, w, c)``, kernel ``(kh, kw, cin, filters)``)."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        filters: int,
        kernel,
        strides=1,
        padding: str = "valid",
        dilation=1,
        activation="linear",
        use_bias: bool = True,
    ):
        self._geometry(in_shape, kernel, strides, padding, dilation)
        self.cout, self.use_bias, self.act = int(filters), use_bias, activations.resolve(activation)
        self.kshape = self.k[1:] if self.rank == 1 else self.k
        self.kk = math.prod(self.kshape) * self.cin
        self.out_shape = (*self.out_hw, self.cout)
        self.pointwise = self.kk == self.cin and self.s == (1, 1) and not any(self.pad)

    def params(self, layer: int) -> list[ParamSpec]:
        r, c, f = math.prod(self.kshape), self.cin, self.cout
        ps = [ParamSpec(layer, "kernel", (*self.kshape, c, f), r * c, r * f, True)]
        return ps + ([ParamSpec(layer, "bias", (f,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        rows = b * self.ho * self.wo
        bufs = {"out": ((b, *self.out_shape), "f"), **self.act.buffers((b, *self.out_shape), train)}
        if not self.pointwise:
            bufs["cols"] = ((rows, self.kk), "f")
        if any(self.pad):
            bufs["xp"] = ((b, *self.padded), "f")
        if train:
            bufs["ones"] = ((rows,), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
                if not self.pointwise:
                    taps = (math.prod(self.k), rows, self.cin)
                    bufs.update({"dtaps": (taps, "f"), "dxp": ((b, *self.padded), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.ho * self.wo * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        if "cols" in ws:
            ws["cols6"] = ws["cols"].reshape(b, self.ho, self.wo, *self.k, self.cin)
        if "dtaps" in ws:
            ws["dtaps5"] = ws["dtaps"].reshape(-1, b, self.ho, self.wo, self.cin)
            ws["dx"] = self.inner(ws["dxp"]).reshape(b, *self.in_shape)

    def forward(self, ws, x, kernel, bias=None):
        if self.pointwise:
            ws["cols"] = cols = x.reshape(-1, self.cin)
        else:
            xp = ws.get("xp")
            if xp is None:
                xp = self.as2d(x)
            else:
                np.copyto(self.inner(xp), self.as2d(x))
            np.copyto(ws["cols6"], self.windows(xp))
            cols = ws["cols"]
        z = self.act.pre(ws).reshape(-1, self.cout)
        np.matmul(cols, kernel.reshape(self.kk, self.cout), out=z)
        if bias is not None:
            np.add(z, bias, out=z)
        return self.act.run(ws)

    def backward_local(self, ws, dout):
        ws["dz2"] = self.act.grad(ws, dout).reshape(-1, self.cout)

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
        else:
            lo, hi = rows
            g = grad.reshape(self.kk, self.cout)
            np.matmul(ws["cols"].T[lo:hi], ws["dz2"], out=g[lo:hi])

    def backward_input(self, ws, dout, kernel, bias=None):
        k2 = kernel.reshape(self.kk, self.cout)
        if self.pointwise:
            np.matmul(ws["dz2"], k2.T, out=ws["dx"].reshape(-1, self.cin))
            return ws["dx"]
        kt = kernel.reshape(-1, self.cin, self.cout).transpose(0, 2, 1)
        np.matmul(ws["dz2"], kt, out=ws["dtaps"])
        dxp, t5 = ws["dxp"], ws["dtaps5"]
        dxp.fill(0)
        for n, (i, j) in enumerate(self.taps()):
            view = self.tap(dxp, i, j)
            np.add(view, t5[n], out=view)
        return ws["dx"]
