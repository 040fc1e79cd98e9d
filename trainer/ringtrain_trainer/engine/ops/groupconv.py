"""Keras ``Conv1D``/``Conv2D`` with ``groups > 1``: the input channels split into ``groups``
equal parts, each convolved with its own ``filters / groups`` kernels (Keras' kernel
``(*k, cin / groups, filters)``, group ``g`` owning output channels ``g*fg:(g+1)*fg``).

Each group is an ordinary :class:`~.conv.Conv` (linear, no bias) on a sub-workspace of this
op's planned buffers (keys ``g<i>.``), so im2col, its padding and its gradients are that op's;
the groups' inputs and output gradients are copied into contiguous planned buffers, kernel and
gradient slices are views. The bias and activation run once over the joined output.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.depthwise import Depthwise
from ringtrain_trainer.engine.tensor import ParamSpec

if TYPE_CHECKING:
    from ringtrain_trainer.engine.ops.conv import ConvWs


class GroupConv(Op):
    kind = "conv"

    def __init__(
        self,
        in_shape,
        filters: int,
        kernel,
        strides=1,
        padding="valid",
        dilation=1,
        activation="linear",
        use_bias=True,
        groups: int = 2,
    ):
        self.in_shape, cin, self.groups = tuple(in_shape), in_shape[-1], int(groups)
        if cin % self.groups or filters % self.groups:
            raise ValueError(f"groups={groups} divides neither {cin} channels nor {filters}")
        self.cg, self.fg = cin // self.groups, filters // self.groups
        sub = (*self.in_shape[:-1], self.cg)
        self.conv = Conv(sub, self.fg, kernel, strides, padding, dilation, "linear", False)
        self.conv.allow_gemm = False
        self.cout, self.use_bias = int(filters), use_bias
        self.act = activations.resolve(activation)
        self.out_shape = (*self.conv.out_shape[:-1], self.cout)

    def params(self, layer):
        (k,) = self.conv.params(layer)
        ps = [
            ParamSpec(
                layer, "kernel", (*k.shape[:-1], self.cout), k.fan_in, k.fan_out * self.groups, True
            )
        ]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f"), **self.act.buffers((b, *self.out_shape), train)}
        bufs["xg"] = ((self.groups, b, *self.conv.in_shape), "f")
        for k, v in self.conv.buffers(b, train, need_dx).items():
            bufs.update({f"g{i}.{k}": v for i in range(self.groups)})
        if train:
            bufs["dg"] = ((self.groups, b, *self.conv.out_shape), "f")
            bufs["ones"] = ((b * int(np.prod(self.out_shape[:-1])),), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return self.groups * self.conv.flops(b, train, need_dx)

    def bind(self, ws: dict[str, Any], b):
        ws["sub"] = []
        for i in range(self.groups):
            pre = f"g{i}."
            sub = {
                k[len(pre) :]: v for k, v in ws.items() if isinstance(k, str) and k.startswith(pre)
            }
            self.conv.bind(cast("ConvWs", sub), b)
            ws["sub"].append(sub)
        if "ones" in ws:
            ws["ones"].fill(1)

    def _sl(self, i: int, n: int) -> slice:
        return slice(i * n, (i + 1) * n)

    def forward(self, ws: dict[str, Any], x, kernel, bias=None):
        z = self.act.pre(ws)
        for i, sub in enumerate(ws["sub"]):
            xg = ws["xg"][i]
            np.copyto(xg, x[..., self._sl(i, self.cg)])
            y = self.conv.forward(sub, xg, kernel[..., self._sl(i, self.fg)])
            np.copyto(z[..., self._sl(i, self.fg)], y)
        if bias is not None:
            np.add(z, bias, out=z)
        return self.act.run(ws)

    def backward_local(self, ws: dict[str, Any], dout):
        ws["dz"] = dz = self.act.grad(ws, dout)
        for i, sub in enumerate(ws["sub"]):
            dg = ws["dg"][i]
            np.copyto(dg, dz[..., self._sl(i, self.fg)])
            self.conv.backward_local(sub, dg)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz"].reshape(-1, self.cout), out=grad)
            return
        for i, sub in enumerate(ws["sub"]):
            g = grad[..., self._sl(i, self.fg)]
            self.conv.backward_weights(sub, ws["dg"][i], "kernel", g, rows)

    def backward_input(self, ws: dict[str, Any], dout, kernel, bias=None):
        dx = ws["dx"]
        for i, sub in enumerate(ws["sub"]):
            k = kernel[..., self._sl(i, self.fg)]
            np.copyto(dx[..., self._sl(i, self.cg)], self.conv.backward_input(sub, ws["dg"][i], k))
        return dx


def depthwise_or_grouped(in_shape, filters, kernel, strides, padding, dilation, act, bias, groups):
    """The op for a grouped convolution: where every group is one channel in and one out
    (``groups == channels == filters``: ConvNeXt's "depthwise" ``Conv2D``) it *is* a depthwise
    convolution, run by the one-pass depthwise op instead of one small convolution per channel
    (96 of them per ConvNeXt-T block); its Keras kernel ``(*k, 1, C)`` holds the depthwise
    kernel's ``(*k, C, 1)`` in the same order."""
    if groups == in_shape[-1] == filters:
        return _GroupedDepthwise(in_shape, kernel, strides, padding, dilation, 1, act, bias)
    return GroupConv(in_shape, filters, kernel, strides, padding, dilation, act, bias, groups)


class _GroupedDepthwise(Depthwise):
    def params(self, layer: int) -> list[ParamSpec]:
        """Conv's fans (in: the window, out: the window times the filters), not depthwise's."""
        kernel, *rest = super().params(layer)
        return [replace(kernel, fan_in=kernel.fan_out, fan_out=kernel.fan_in), *rest]
