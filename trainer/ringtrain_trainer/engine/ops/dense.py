"""Dense on any rank, and the row-block arithmetic every op with a matmul-shaped weight
gradient shares.

Keras applies a Dense kernel to the last axis only: ``(b, ..., n_in) → (b, ..., n_out)``. Every
leading axis is a batch axis, so the op is one matmul on the ``(b·L, n_in)`` view (no copy: the
input is contiguous) — a sequence model's per-timestep Dense is as fast as a flat one.

Why :func:`product_rows`: a weight gradient is streamed in row blocks of the parameter's
``(size // shape[-1], shape[-1])`` matrix view (``engine.plan``), but the gradient is computed
as a product ``a.T @ d`` whose rows may be coarser than the view's — an attention query kernel
``(d, heads, key_dim)`` is the product's ``(d, heads·key_dim)`` but streams in
``(d·heads, key_dim)`` rows. The helper writes exactly the block asked for: whole product rows
straight into the gradient, a partial row at either end through one row of workspace.
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.activations import resolve
from ringtrain_trainer.engine.tensor import ParamSpec


def product_rows(a: np.ndarray, d: np.ndarray, grad: np.ndarray, rows, tmp: np.ndarray) -> None:
    """Write rows ``rows = (lo, hi)`` of ``grad``'s matrix view, where the whole gradient is
    ``a.T @ d`` (``a``: (n, R), ``d``: (n, C); ``grad.size == R·C``). ``tmp``: a (C,) buffer
    for a product row cut by the block."""
    lo, hi = rows
    width = grad.shape[-1] if grad.ndim else 1
    cols = d.shape[1]
    flat, g2 = grad.reshape(-1), grad.reshape(-1, cols)
    start, stop = lo * width, hi * width
    r0, r1 = -(-start // cols), stop // cols  # the whole product rows inside the block
    if r1 > r0:
        np.matmul(a[:, r0:r1].T, d, out=g2[r0:r1])
    for r in {start // cols, (stop - 1) // cols} - set(range(r0, r1)):
        np.matmul(a[:, r], d, out=tmp)
        s, e = max(start, r * cols), min(stop, (r + 1) * cols)
        flat[s:e] = tmp[s - r * cols : e - r * cols]


class Dense(Op):
    """Keras ``Dense`` on input ``(b, *lead, n_in)``; any activation of
    ``engine.ops.activations`` (the table plans the pre-activation where its gradient reads it)."""

    kind = "dense"

    def __init__(self, in_shape, units: int, activation: str = "linear", use_bias: bool = True):
        self.fn = resolve(activation)
        self.in_shape = tuple(in_shape)
        self.n_in, self.n_out = self.in_shape[-1], units
        self.out_shape = (*self.in_shape[:-1], units)
        self.lead = math.prod(self.in_shape[:-1])
        self.act, self.use_bias = self.fn.name, use_bias

    def params(self, layer):
        ps = [ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True)]
        if self.use_bias:
            ps.append(ParamSpec(layer, "bias", (self.n_out,), 0, 0, False))
        return ps

    def buffers(self, b, train, need_dx):
        n = b * self.lead
        bufs = {"out": ((b, *self.out_shape), "f"), **self.fn.buffers((b, *self.out_shape), train)}
        if train:
            bufs["ones"] = ((n,), "f")
            bufs["row"] = ((self.n_out,), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 2 * b * self.lead * self.n_in * self.n_out * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)

    def forward(self, ws, x, kernel, bias=None):
        ws["x"] = x2 = x.reshape(-1, self.n_in)
        z2 = self.fn.pre(ws).reshape(-1, self.n_out)
        np.matmul(x2, kernel, out=z2)
        if bias is not None:
            np.add(z2, bias, out=z2)
        return self.fn.run(ws)

    def backward_local(self, ws, dout):
        ws["g"] = self.fn.grad(ws, dout).reshape(-1, self.n_out)

    def backward_input(self, ws, dout, kernel, bias=None):
        dx = ws["dx"]
        np.matmul(ws["g"], kernel.T, out=dx.reshape(-1, self.n_in))
        return dx

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["g"], out=grad)
        else:
            product_rows(ws["x"], ws["g"], grad, rows, ws["row"])


class Linear(Op):
    """Dense on a flat input, any activation of ``engine.ops.activations`` (the table keeps the
    pre-activation where its gradient reads it: gelu, swish, ...), with or without bias."""

    kind = "dense"

    def __init__(self, n_in, n_out, activation="linear", use_bias=True):
        self.n_in, self.n_out, self.use_bias = n_in, n_out, use_bias
        self.fn = resolve(activation)
        #: the activation's name (what the loss folding and the tests read)
        self.act = self.fn.name
        self.out_shape = (n_out,)

    def params(self, layer):
        ps = [ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True)]
        return ps + (
            [ParamSpec(layer, "bias", (self.n_out,), 0, 0, False)] if self.use_bias else []
        )

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, self.n_out), "f"), **self.fn.buffers((b, self.n_out), train)}
        if train:
            bufs["ones"] = ((b,), "f")
            if need_dx:
                bufs["dx"] = ((b, self.n_in), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 2 * b * self.n_in * self.n_out * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)

    def forward(self, ws, x, kernel, bias=None):
        ws["x"] = x2 = x.reshape(x.shape[0], self.n_in)
        z = self.fn.pre(ws)
        np.matmul(x2, kernel, out=z)
        if bias is not None:
            np.add(z, bias, out=z)
        return self.fn.run(ws)

    def backward_local(self, ws, dout):
        ws["g"] = self.fn.grad(ws, dout)

    def backward_input(self, ws, dout, kernel, bias=None):
        return np.matmul(ws["g"], kernel.T, out=ws["dx"])

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["g"], out=grad)
        else:
            lo, hi = rows
            np.matmul(ws["x"].T[lo:hi], ws["g"], out=grad[lo:hi])
