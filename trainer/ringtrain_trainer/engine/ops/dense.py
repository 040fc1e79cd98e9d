"""Dense — the one op for every Keras ``Dense`` — and the row-block arithmetic every op with a
matmul-shaped weight gradient shares.

One op, two paths chosen once at construction: the **fast path** (a flat input, ``relu`` or
``linear``, a bias: the seeds' classifier) runs the compiled GEMM where it beat OpenBLAS
(``engine.native``: AVX-512) and keeps a bool mask of the ReLU instead of a pre-activation; the
**general path** takes any rank and any activation of ``activations``' table.

Keras applies a Dense kernel to the last axis only: ``(b, ..., n_in) → (b, ..., n_out)``. Every
leading axis is a batch axis, so the op is one matmul on the ``(b·L, n_in)`` view (no copy: the
input is contiguous) — a sequence model's per-timestep Dense is as fast as a flat one.

Why :func:`product_rows`: a weight gradient is streamed in row blocks of the parameter's
``(size // shape[-1], shape[-1])`` matrix view (``engine.plan``), but the gradient is computed
as a product ``a.T @ d`` whose rows may be coarser than the view's — an attention query kernel
``(d, heads, key_dim)`` is the product's ``(d, heads·key_dim)`` but streams in
``(d·heads, key_dim)`` rows. The helper computes the product whole at the first block, so its
bits never depend on the grid.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine import native
from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.activations import resolve
from ringtrain_trainer.engine.tensor import ParamSpec


def product_rows(a: np.ndarray, d: np.ndarray, grad: np.ndarray, rows) -> None:
    """The gradient ``a.T @ d`` (``a``: (n, R), ``d``: (n, C); ``grad.size == R·C``) for its
    streamed block ``rows = (lo, hi)`` of ``grad``'s matrix view: written whole at the first
    block (backward asks a parameter's blocks in order, from row 0) and left for the later ones,
    which only announce rows already written. Why whole: BLAS may sum a block of a product's
    rows in another order than the whole product (OpenBLAS's Haswell and Zen kernels do, its
    SkylakeX ones do not), and the grid depends on the ring's size, so a product cut by the grid
    gave other bits on other CPUs (issue 34)."""
    if rows[0] == 0:
        np.matmul(a.T, d, out=grad.reshape(-1, d.shape[1]))


class DenseWs(TypedDict, total=False):
    """The buffers :class:`Dense` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    dz: np.ndarray
    g: np.ndarray
    gemm: bool
    gemm_dx: bool
    mask: np.ndarray
    ones: np.ndarray
    out: np.ndarray
    x: np.ndarray
    x_cols: np.ndarray
    x_rows: np.ndarray


class Dense(Op):
    """Keras ``Dense`` on input ``(b, *lead, n_in)``; any activation of
    ``engine.ops.activations`` (the table plans the pre-activation where its gradient reads it),
    with the fast path inside (:attr:`fast`, the module docstring)."""

    kind = "dense"

    def __init__(
        self,
        in_shape,
        units: int,
        activation: str = "linear",
        use_bias: bool = True,
        fast: bool | None = None,
    ):
        """``fast``: None takes the fast path wherever it fits; False forces the general one
        (the tests hold the two to the same numbers)."""
        self.fn = resolve(activation)
        self.in_shape = tuple(in_shape)
        self.n_in, self.n_out = self.in_shape[-1], units
        self.out_shape = (*self.in_shape[:-1], units)
        self.lead = math.prod(self.in_shape[:-1])
        self.act, self.use_bias = self.fn.name, use_bias
        #: the seeds' fast path: a flat input, relu or linear, a bias
        fits = len(self.in_shape) == 1 and use_bias and self.act in ("relu", "linear")
        self.fast = fits if fast is None else fast and fits
        self.relu = self.act == "relu"

    def params(self, layer):
        ps = [ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True)]
        if self.use_bias:
            ps.append(ParamSpec(layer, "bias", (self.n_out,), 0, 0, False))
        return ps

    def buffers(self, b, train, need_dx):
        bufs: dict[str, tuple[tuple[int, ...], str]]
        if self.fast:
            bufs = {"out": ((b, self.n_out), "f")}
            if train:
                bufs["dz"] = ((b, self.n_out), "f")
                bufs["ones"] = ((b,), "f")
                if self.relu:
                    bufs["mask"] = ((b, self.n_out), "?")
                if need_dx:
                    bufs["dx"] = ((b, self.n_in), "f")
            return bufs
        n = b * self.lead
        bufs = {"out": ((b, *self.out_shape), "f"), **self.fn.buffers((b, *self.out_shape), train)}
        if train:
            bufs["ones"] = ((n,), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 2 * b * self.lead * self.n_in * self.n_out * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: DenseWs, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        if not self.fast:
            return
        ws["gemm"] = native.gemm_runs(self.n_out, ws["out"].dtype)
        if ws["gemm"]:  # x's rows and columns, for x @ W and x^T @ dz
            ws["x_rows"] = native.offsets((b, self.n_in))
            ws["x_cols"] = native.offsets((self.n_in, 1))
        ws["gemm_dx"] = ws["gemm"] and self.n_in % 16 == 0 and self.n_out % 8 == 0

    def forward(self, ws: DenseWs, x, kernel, bias=None):
        if self.fast:
            x2 = x.reshape(x.shape[0], self.n_in)
            ws["x"] = x2
            out = ws["out"]
            if ws["gemm"]:
                native.loaded().gemm(x2, ws["x_rows"], ws["x_cols"], kernel, out, self.n_out)
            else:
                np.matmul(x2, kernel, out=out)
            np.add(out, bias, out=out)
            if self.relu:
                np.maximum(out, 0, out=out)
            return out
        ws["x"] = x2 = x.reshape(-1, self.n_in)
        z2 = self.fn.pre(ws).reshape(-1, self.n_out)
        np.matmul(x2, kernel, out=z2)
        if bias is not None:
            np.add(z2, bias, out=z2)
        return self.fn.run(ws)

    def backward_local(self, ws: DenseWs, dout):
        if not self.fast:
            ws["g"] = self.fn.grad(ws, dout).reshape(-1, self.n_out)
            return
        dz = ws["g"] = ws["dz"]
        if self.relu:
            np.greater(ws["out"], 0, out=ws["mask"])
            np.multiply(dout, ws["mask"], out=dz)
        else:
            np.copyto(dz, dout)

    def backward_input(self, ws: DenseWs, dout, kernel, bias=None):
        dx = ws["dx"]
        if self.fast and ws["gemm_dx"]:
            dz = ws["dz"]
            native.loaded().gemm_nt(dz, kernel, dx, dz.shape[0], self.n_in, self.n_out)
            return dx
        np.matmul(ws["g"], kernel.T, out=dx.reshape(-1, self.n_in))
        return dx

    def backward_weights(self, ws: DenseWs, dout, name, grad, rows):
        """A row block ``dW[rows] = x[:, rows]^T dz`` is the same dot products as the whole
        product, so streaming the kernel in blocks changes no bit of it."""
        if name == "bias":
            np.matmul(ws["ones"], ws["g"], out=grad)
        elif self.fast and ws["gemm"]:
            lo, hi = rows
            cols = ws["x_cols"][lo:hi]
            native.loaded().gemm(ws["x"], cols, ws["x_rows"], ws["dz"], grad[lo:hi], self.n_out)
        else:
            product_rows(ws["x"], ws["g"], grad, rows)
