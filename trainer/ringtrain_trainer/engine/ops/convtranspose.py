"""Keras ``Conv1DTranspose`` / ``Conv2DTranspose`` (strides, padding ``valid``/``same``,
``output_padding``) as a stride-1 convolution of the zero-inserted input.

A transposed convolution scatters each input pixel's ``kernel``-sized patch into the output at
``stride`` steps. The same numbers come from putting ``stride - 1`` zeros between input pixels,
padding by ``kernel - 1 - before`` (``before``: the padding the forward convolution of this
geometry would have put first) and running an ordinary valid convolution with the kernel
flipped in space and its two channel axes swapped — so the op is a planned
:class:`~.conv.Conv` on its own sub-workspace (im2col, BLAS, its gradients), plus one strided
copy in and out and a kernel-sized flip each way per step. The output length is Keras'
``deconv_output_length``: ``valid`` ``(n-1)·s + max(k, s)``, ``same`` ``n·s``; with
``output_padding`` ``(n-1)·s + k - 2·(k//2 if same else 0) + output_padding``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.tensor import ParamSpec


def output_length(n: int, k: int, s: int, padding: str, output_padding: int | None) -> int:
    """Keras' ``deconv_output_length`` (dilation 1)."""
    if output_padding is None:
        return n * s + max(k - s, 0) if padding == "valid" else n * s
    pad = k // 2 if padding == "same" else 0
    return (n - 1) * s + k - 2 * pad + output_padding


class ConvTranspose(Op):
    kind = "conv"

    def __init__(
        self, in_shape, filters, kernel, strides, padding="valid", output_padding=None,
        activation="linear", use_bias=True,
    ):  # fmt: skip
        self.in_shape = tuple(in_shape)
        rank = len(self.in_shape) - 1
        self.k, self.s = tuple(kernel), tuple(strides)
        ops = output_padding or [None] * rank
        n_out = [
            output_length(n, k, s, padding, o)
            for n, k, s, o in zip(self.in_shape[:-1], self.k, self.s, ops, strict=True)
        ]
        #: where the zero-inserted input sits in the padded buffer, per spatial axis
        self.place = []
        for n, k, s, no in zip(self.in_shape[:-1], self.k, self.s, n_out, strict=True):
            total = max((-(-no // s) - 1) * s + k - no, 0) if padding == "same" else 0
            before = total // 2
            if before > k - 1:
                raise ValueError(f"padding {padding} with kernel {k}, stride {s}: not supported")
            self.place.append(slice(k - 1 - before, k - 1 - before + (n - 1) * s + 1, s))
        self.cin, self.cout, self.use_bias = self.in_shape[-1], int(filters), bool(use_bias)
        big = (*(no + k - 1 for no, k in zip(n_out, self.k, strict=True)), self.cin)
        self.conv = Conv(big, self.cout, self.k, 1, "valid", 1, "linear", False)
        self.act = activations.resolve(activation)
        self.out_shape = (*n_out, self.cout)
        self.kshape = (*self.k, self.cout, self.cin)  # Keras': (*k, filters, in_channels)

    def params(self, layer):
        r = math.prod(self.k)
        ps = [ParamSpec(layer, "kernel", self.kshape, r * self.cout, r * self.cin, True)]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f"), **self.act.buffers((b, *self.out_shape), train)}
        bufs["big"] = ((b, *self.conv.in_shape), "f")
        bufs["kc"] = ((*self.k, self.cin, self.cout), "f")
        bufs.update({f"c.{k}": v for k, v in self.conv.buffers(b, train, True).items()})
        if train:
            bufs["gk"] = ((*self.k, self.cin, self.cout), "f")
            bufs["ones"] = ((b * math.prod(self.out_shape[:-1]),), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return self.conv.flops(b, train, need_dx)

    def bind(self, ws: dict[str, Any], b):
        ws["sub"] = {k[2:]: v for k, v in ws.items() if isinstance(k, str) and k.startswith("c.")}
        self.conv.bind(ws["sub"], b)
        ws["big"].fill(0)  # the inserted zeros and the padding stay zero
        if "ones" in ws:
            ws["ones"].fill(1)

    def _inner(self, a):
        return a[(slice(None), *self.place)]

    def _flip(self, kernel):
        """Keras' ``(*k, filters, cin)`` kernel as the equivalent convolution's
        ``(*k, cin, filters)``: flipped in space, channel axes swapped (an involution)."""
        rank = len(self.k)
        return kernel[(slice(None, None, -1),) * rank].swapaxes(rank, rank + 1)

    def forward(self, ws: dict[str, Any], x, kernel, bias=None):
        np.copyto(self._inner(ws["big"]), x.reshape(x.shape[0], *self.in_shape))
        np.copyto(ws["kc"], self._flip(kernel.reshape(self.kshape)))
        z = self.act.pre(ws)
        np.copyto(z, self.conv.forward(ws["sub"], ws["big"], ws["kc"]))
        if bias is not None:
            np.add(z, bias, out=z)
        return self.act.run(ws)

    def backward_local(self, ws: dict[str, Any], dout):
        ws["dz"] = dz = self.act.grad(ws, dout)
        self.conv.backward_local(ws["sub"], dz)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz"].reshape(-1, self.cout), out=grad)
            return
        if rows[0]:  # every row is written with the first block, as Conv's chunked path does
            return
        gk = ws["gk"]
        self.conv.backward_weights(ws["sub"], ws["dz"], "kernel", gk, (0, self.conv.kk))
        np.copyto(grad.reshape(self.kshape), self._flip(gk))

    def backward_input(self, ws: dict[str, Any], dout, kernel, bias=None):
        dbig = self.conv.backward_input(ws["sub"], ws["dz"], ws["kc"])
        dx = ws["dx"]
        np.copyto(dx, self._inner(dbig.reshape(ws["big"].shape)))
        return dx
