"""DepthwiseConv1D/2D (``depth_multiplier``) and SeparableConv1D/2D (depthwise, then a
pointwise product, then bias and activation), channels last.

Why not im2col + BLAS here: each channel has its own tiny filter, so there is no shared matrix
to multiply; the op is memory-bound and runs as one multiply-add over the whole batch per
kernel tap (``kh * kw`` vectorised passes), with one planned product buffer. Output channel
``c * depth_multiplier + m`` is input channel ``c`` under filter ``m``, as Keras orders them.
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.engine.ops.window import Window
from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer


class Depthwise(Window, Layer):
    """Keras ``DepthwiseConv1D`` / ``DepthwiseConv2D``: kernel ``(*kernel, cin, multiplier)``."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        kernel,
        strides=1,
        padding: str = "valid",
        dilation=1,
        depth_multiplier: int = 1,
        activation="linear",
        use_bias: bool = True,
    ):
        self._geometry(in_shape, kernel, strides, padding, dilation)
        self.m, self.use_bias = int(depth_multiplier), use_bias
        self.act = activations.resolve(activation)
        self.kshape = self.k[1:] if self.rank == 1 else self.k
        self.cout = self.cin * self.m
        self.out_shape = (*self.out_hw, self.cout)

    def params(self, layer: int) -> list[ParamSpec]:
        r = math.prod(self.kshape)
        shape = (*self.kshape, self.cin, self.m)
        ps = [ParamSpec(layer, "kernel", shape, r * self.cin, r * self.m, True)]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        out = (b, *self.out_shape)
        bufs = {"out": (out, "f"), **self.act.buffers(out, train)}
        bufs["tap"] = ((b, self.ho, self.wo, self.cin), "f")
        if any(self.pad):
            bufs["xp"] = ((b, *self.padded), "f")
        if train:
            bufs["ones"] = ((b * self.ho * self.wo,), "f")
            if need_dx:
                bufs["dxp"] = ((b, *self.padded), "f")
        return bufs

    def flops(self, b, train, need_dx):
        per = 2 * b * self.ho * self.wo * self.cout * math.prod(self.kshape)
        return per * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        if "dxp" in ws:
            ws["dx"] = self.inner(ws["dxp"]).reshape(b, *self.in_shape)

    def _k(self, kernel):
        return kernel.reshape(*self.k, self.cin, self.m)

    def forward(self, ws, x, kernel, bias=None):
        xp = ws.get("xp")
        if xp is None:
            xp = self.as2d(x)
        else:
            np.copyto(self.inner(xp), self.as2d(x))
        ws["xin"], k, t = xp, self._k(kernel), ws["tap"]
        z = self.act.pre(ws)
        z5 = z.reshape(*t.shape, self.m)
        for n, (i, j) in enumerate(self.taps()):  # one (b, ho, wo, c) pass per tap and filter
            v = self.tap(xp, i, j)
            for m in range(self.m):
                if n == 0:
                    np.multiply(v, k[i, j, :, m], out=z5[..., m])
                else:
                    np.multiply(v, k[i, j, :, m], out=t)
                    np.add(z5[..., m], t, out=z5[..., m])
        if bias is not None:
            np.add(z, bias, out=z)
        return self.act.run(ws)

    def backward_local(self, ws, dout):
        dz = self.act.grad(ws, dout)
        ws["dz5"] = dz.reshape(*ws["tap"].shape, self.m)
        ws["dz2"] = dz.reshape(-1, self.cout)

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
            return
        lo, hi = rows
        c, g, t4, dz5 = self.cin, grad.reshape(-1, self.cin, self.m), ws["tap"], ws["dz5"]
        for p, (i, j) in enumerate(self.taps()):
            c0, c1 = max(lo - p * c, 0), min(hi - p * c, c)
            if c1 <= c0:
                continue
            v = self.tap(ws["xin"], i, j)
            for m in range(self.m):
                t = t4[..., : c1 - c0]
                np.multiply(v[..., c0:c1], dz5[..., c0:c1, m], out=t)
                if c1 - c0 == c:  # a whole tap: the column sums as one BLAS product
                    np.matmul(ws["ones"], t4.reshape(len(ws["ones"]), c), out=g[p, :, m])
                else:
                    np.sum(t, axis=(0, 1, 2), out=g[p, c0:c1, m])

    def backward_input(self, ws, dout, kernel, bias=None):
        k, t, dxp, dz5 = self._k(kernel), ws["tap"], ws["dxp"], ws["dz5"]
        dxp.fill(0)
        for i, j in self.taps():
            view = self.tap(dxp, i, j)
            for m in range(self.m):
                np.multiply(dz5[..., m], k[i, j, :, m], out=t)
                np.add(view, t, out=view)
        return ws["dx"]


class Separable(Layer):
    """Keras ``SeparableConv1D`` / ``SeparableConv2D``: weights ``depthwise_kernel``
    ``(*kernel, cin, multiplier)``, ``pointwise_kernel`` ``(*ones, cin * multiplier,
    filters)``, ``bias`` — a :class:`Depthwise` (its buffers prefixed ``dw_``) and a product."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        filters: int,
        kernel,
        strides=1,
        padding: str = "valid",
        dilation=1,
        depth_multiplier: int = 1,
        activation="linear",
        use_bias: bool = True,
    ):
        self.dw = Depthwise(
            in_shape, kernel, strides, padding, dilation, depth_multiplier, "linear", use_bias=False
        )
        self.in_shape, self.use_bias = self.dw.in_shape, use_bias
        self.cmid, self.cout = self.dw.cout, int(filters)
        self.act = activations.resolve(activation)
        self.out_shape = (*self.dw.out_hw, self.cout)

    def params(self, layer: int) -> list[ParamSpec]:
        d = self.dw.params(layer)[0]
        ones = (1,) * self.dw.rank
        ps = [
            ParamSpec(layer, "depthwise_kernel", d.shape, d.fan_in, d.fan_out, True),
            ParamSpec(
                layer, "pointwise_kernel", (*ones, self.cmid, self.cout), self.cmid, self.cout, True
            ),
        ]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        out = (b, *self.out_shape)
        bufs = {f"dw_{k}": v for k, v in self.dw.buffers(b, train, need_dx).items()}
        bufs.update({"out": (out, "f"), **self.act.buffers(out, train)})
        if train:
            rows = b * self.dw.ho * self.dw.wo
            bufs.update({"ones": ((rows,), "f"), "dmid": ((rows, self.cmid), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.dw.ho * self.dw.wo * self.cmid * self.cout
        return self.dw.flops(b, train, need_dx) + mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        ws["dw"] = {k[3:]: v for k, v in ws.items() if k.startswith("dw_")}
        self.dw.bind(ws["dw"], b)
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["mid"] = ws["dw"]["out"].reshape(-1, self.cmid)

    def forward(self, ws, x, depthwise_kernel, pointwise_kernel, bias=None):
        self.dw.forward(ws["dw"], x, depthwise_kernel)
        ws["pk"] = pk = pointwise_kernel.reshape(self.cmid, self.cout)
        z = self.act.pre(ws).reshape(-1, self.cout)
        np.matmul(ws["mid"], pk, out=z)
        if bias is not None:
            np.add(z, bias, out=z)
        return self.act.run(ws)

    def backward_local(self, ws, dout):
        # the depthwise half needs d(mid) = dz @ pointwise.T: computed here, before any weight
        # gradient is announced (a resident pointwise kernel may be updated right after)
        ws["dz2"] = dz2 = self.act.grad(ws, dout).reshape(-1, self.cout)
        np.matmul(dz2, ws["pk"].T, out=ws["dmid"])
        self.dw.backward_local(ws["dw"], ws["dmid"])

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
        elif name == "pointwise_kernel":
            lo, hi = rows
            g = grad.reshape(self.cmid, self.cout)
            np.matmul(ws["mid"].T[lo:hi], ws["dz2"], out=g[lo:hi])
        else:
            self.dw.backward_weights(ws["dw"], ws["dmid"], "kernel", grad, rows)

    def backward_input(self, ws, dout, depthwise_kernel, pointwise_kernel, bias=None):
        return self.dw.backward_input(ws["dw"], ws["dmid"], depthwise_kernel)
