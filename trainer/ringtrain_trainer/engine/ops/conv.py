"""Conv1D, Conv2D and Conv3D with any kernel, strides, dilation and padding (``valid``,
``same``, and ``causal`` for 1-D): im2col as a strided view copied into one planned buffer,
then one BLAS product forward, one per weight row block, and one batched product for the input
gradient.

The input gradient is computed per kernel tap (``dz @ kernel[i, j].T``, one batched product
into a ``(taps, rows, cin)`` buffer), not as one ``(rows, kh*kw*cin)`` matrix scattered back
(col2im): each tap's block is then contiguous and adds onto the padded input gradient with
whole image rows as the inner loop, where col2im's inner loop was ``cin`` floats at a stride of
``kh*kw*cin``. py-spy on the zoo's ``resnet_add`` (3x3 ``same``, 6 channels): col2im was 47 %
of the step; the scatter 4.0 -> 1.2 ms at its shape, 90 -> 63 ms at 26x26x32->64 (one core).

A 1x1 convolution with unit strides and no padding (MobileNet's pointwise layers) skips
im2col: the input already is the column matrix.

Where the compiled GEMM runs (float32, at most 64 filters, AVX-512: ``engine.native``) there is
no im2col at all: the product reads the padded input in place through two offset tables
(output positions, kernel taps), the kernel gradient reads it the other way round, and with unit
strides the input gradient is itself such a convolution of the output gradient (copied into a
buffer with zero margins) with the kernel's taps transposed. On the zoo's ``resnet_add`` (3x3
``same``, 6 channels, one core) the step went 4.5 -> 1.8 ms."""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine import native
from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activations, tiles
from ringtrain_trainer.engine.ops.window import Window
from ringtrain_trainer.engine.tensor import ParamSpec


class ConvWs(TypedDict, total=False):
    """The buffers :class:`Conv` is compiled with (``buffers``, its state, ``bind``)."""

    bt: np.ndarray
    c: int
    cols: np.ndarray
    cols6: np.ndarray
    dtaps: np.ndarray
    dtaps5: np.ndarray
    dx: np.ndarray
    dx_c: np.ndarray
    dx_red: np.ndarray
    dx_rows: np.ndarray
    dxp: np.ndarray
    dz2: np.ndarray
    dzp: np.ndarray
    dzp_in: np.ndarray
    gemm: bool
    gpart: np.ndarray
    kt: np.ndarray
    ones: np.ndarray
    out: np.ndarray
    pixels: np.ndarray
    taps: np.ndarray
    x: np.ndarray
    xin: np.ndarray
    xp: np.ndarray


class Conv(Window, Op):
    """Keras ``Conv1D`` (input ``(steps, channels)``, kernel ``(k, cin, filters)``),
    ``Conv2D`` (input ``(h, w, c)``, kernel ``(kh, kw, cin, filters)``) and ``Conv3D`` (input
    ``(d, h, w, c)``, kernel ``(kd, kh, kw, cin, filters)``)."""

    kind = "conv"
    #: examples per chunk under ``available_memory_proportion`` (``engine.workspace``): the
    #: im2col workspace is planned for one chunk and forward/backward loop over the batch;
    #: None: the whole batch at once
    chunk: int | None = None
    #: whether the compiled GEMM may run this conv (a grouped conv's per-group convs read and
    #: write strided channel slices, which its offset tables do not describe)
    allow_gemm: bool = True

    def chunk_elems(self, c: int, train: bool, need_dx: bool) -> int:
        """Elements of the batch-proportional im2col workspace for ``c`` examples."""
        if self.pointwise:
            return 0
        rows = c * self.npos
        n = rows * self.kk + (c * math.prod(self.padded) if any(self.pad) else 0)
        return n + (math.prod(self.k) * rows * self.cin if train and need_dx else 0)

    def fixed_elems(self) -> int:
        """Workspace a chunked conv adds whatever its chunk: one kernel-gradient partial sum."""
        return self.kk * self.cout

    def _c(self, b: int) -> int:
        """Examples per planned chunk for batch ``b``: the fewest equal chunks that fit."""
        if self.chunk is None or self.pointwise or self.chunk >= b:
            return b
        return -(-b // -(-b // self.chunk))

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
        self.pointwise = self.kk == self.cin and max(self.s) == 1 and not any(self.pad)

    def params(self, layer: int) -> list[ParamSpec]:
        r, c, f = math.prod(self.kshape), self.cin, self.cout
        ps = [ParamSpec(layer, "kernel", (*self.kshape, c, f), r * c, r * f, True)]
        return ps + ([ParamSpec(layer, "bias", (f,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        c = self._c(b)
        rows, crows = b * self.npos, c * self.npos
        bufs = {"out": ((b, *self.out_shape), "f"), **self.act.buffers((b, *self.out_shape), train)}
        if not self.pointwise:
            bufs["cols"] = ((crows, self.kk), "f")
        if any(self.pad):
            bufs["xp"] = ((c, *self.padded), "f")
        if c < b and train:
            bufs["gpart"] = ((self.kk, self.cout), "f")
        if self.use_bias:
            bufs["bt"] = ((tiles.span(rows * self.cout, self.cout),), "f")
        if train:
            bufs["ones"] = ((rows,), "f")
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
                if not self.pointwise:
                    taps = (math.prod(self.k), crows, self.cin)
                    bufs.update({"dtaps": (taps, "f"), "dxp": ((b, *self.padded), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.npos * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: ConvWs, b):
        c = ws["c"] = self._c(b)
        if "ones" in ws:
            ws["ones"].fill(1)
        if "cols" in ws:
            ws["cols6"] = ws["cols"].reshape(c, *self.osp, *self.k, self.cin)
        if "dtaps" in ws:
            ws["dtaps5"] = ws["dtaps"].reshape(-1, c, *self.osp, self.cin)
            ws["dx"] = self.inner(ws["dxp"]).reshape(b, *self.in_shape)
        #: the compiled GEMM reads the (padded) input in place through offset tables: no
        #: im2col matrix is written (engine.native, gemm.h); one chunk, whole batch
        ws["gemm"] = (
            self.allow_gemm and c == b and native.gemm_runs(self.cout, ws["out"].dtype, conv=True)
        )
        if ws["gemm"]:
            sp = self.padded[:-1] if "xp" in ws else self.sp
            st = [math.prod(sp[a + 1 :]) * self.cin for a in range(len(sp))]
            ws["pixels"] = native.offsets(
                (b, math.prod(sp) * self.cin),
                *((o, s * t) for o, s, t in zip(self.osp, self.s, st, strict=True)),
            )
            ws["taps"] = native.offsets(
                *((k, d * t) for k, d, t in zip(self.k, self.d, st, strict=True)), (self.cin, 1)
            )
            if "dtaps" in ws and max(self.s) == 1:
                self._bind_gemm_dx(ws, b)

    def _bind_gemm_dx(self, ws: ConvWs, b):
        """The input gradient as a convolution of the output gradient, read in place from a
        copy with zero margins (``dzp``): dx[y] = sum over taps t and filters f of
        dz[y + pad - t * d, f] * kernel[t, :, f] (unit strides). The kernel is given as
        (taps x filters, cin) in ``kt``."""
        margin = [(k - 1) * d for k, d in zip(self.k, self.d, strict=True)]
        q = [o + 2 * m for o, m in zip(self.osp, margin, strict=True)]
        st = [math.prod(q[a + 1 :]) * self.cout for a in range(len(q))]
        lo = self.pad[::2]
        ws["dzp"] = np.zeros((b, *q, self.cout), np.float32)
        ws["dzp_in"] = ws["dzp"][
            (slice(None), *(slice(m, m + o) for m, o in zip(margin, self.osp, strict=True)))
        ]
        ws["dx_rows"] = native.offsets(
            (b, math.prod(q) * self.cout),
            *((n, t) for n, t in zip(self.sp, st, strict=True)),
        )
        # row y's base is y + pad (in dzp: + margin - margin); tap t adds (k - 1 - t) * d
        base = sum(p * t for p, t in zip(lo, st, strict=True))
        ws["dx_rows"] += np.int32(base)
        ws["dx_red"] = native.offsets(
            *((k, -d * t) for k, d, t in zip(self.k, self.d, st, strict=True)), (self.cout, 1)
        )
        ws["dx_red"] += np.int32(sum(m * t for m, t in zip(margin, st, strict=True)))
        ws["kt"] = np.zeros((math.prod(self.k) * self.cout, self.cin), np.float32)
        ws["dx_c"] = np.zeros((b, *self.in_shape), np.float32)

    def _slices(self, ws: ConvWs, b: int):
        """The batch chunks ``(start, stop)`` this program runs the op in, in order."""
        c = ws["c"]
        return [(s, min(s + c, b)) for s in range(0, b, c)]

    def _im2col(self, ws: ConvWs, x) -> np.ndarray:
        """Fill the column buffer for the examples of ``x`` (at most one chunk); its rows."""
        n = x.shape[0]
        xp = ws.get("xp")
        if xp is None:
            xp = self.as2d(x)
        else:
            xp = xp[:n]
            np.copyto(self.inner(xp), self.as2d(x))
        np.copyto(ws["cols6"][:n], self.windows(xp))
        return ws["cols"][: n * self.npos]

    def forward(self, ws: ConvWs, x, kernel, bias=None):
        z = self.act.pre(ws).reshape(-1, self.cout)
        k2 = kernel.reshape(self.kk, self.cout)
        if ws["gemm"]:
            xin = ws.get("xp")
            if xin is None:
                xin = x
            else:
                np.copyto(self.inner(xin), self.as2d(x))
            ws["xin"] = xin
            native.loaded().gemm(xin, ws["pixels"], ws["taps"], k2, z, self.cout)
        elif self.pointwise:
            ws["cols"] = cols = x.reshape(-1, self.cin)
            np.matmul(cols, k2, out=z)
        else:
            ws["x"], r = x, self.npos
            for s, e in self._slices(ws, x.shape[0]):
                np.matmul(self._im2col(ws, x[s:e]), k2, out=z[s * r : e * r])
        if bias is not None:
            tiles.add_bias(z, bias, ws["bt"])
        return self.act.run(ws)

    def backward_local(self, ws: ConvWs, dout):
        ws["dz2"] = self.act.grad(ws, dout).reshape(-1, self.cout)

    def backward_weights(self, ws: ConvWs, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
        else:
            lo, hi = rows
            g = grad.reshape(self.kk, self.cout)
            if ws["gemm"]:
                dz2, taps = np.ascontiguousarray(ws["dz2"]), ws["taps"][lo:hi]
                native.loaded().gemm(ws["xin"], taps, ws["pixels"], dz2, g[lo:hi], self.cout)
                return
            if "gpart" not in ws:
                np.matmul(ws["cols"].T[lo:hi], ws["dz2"], out=g[lo:hi])
                return
            # chunked: im2col again per chunk (the cycles the smaller workspace costs); every
            # row is written with the first block, before any block of this kernel streams out
            if lo:
                return
            x, dz2, r, part = ws["x"], ws["dz2"], self.npos, ws["gpart"]
            for n, (s, e) in enumerate(self._slices(ws, x.shape[0])):
                cols = self._im2col(ws, x[s:e])
                np.matmul(cols.T, dz2[s * r : e * r], out=g if n == 0 else part)
                if n:
                    np.add(g, part, out=g)

    def backward_input(self, ws: ConvWs, dout, kernel, bias=None):
        k2 = kernel.reshape(self.kk, self.cout)
        if self.pointwise:
            np.matmul(ws["dz2"], k2.T, out=ws["dx"].reshape(-1, self.cin))
            return ws["dx"]
        if "dx_c" in ws:
            kt, dzp_in = ws["kt"], ws["dzp_in"]
            per_tap = kernel.reshape(-1, self.cin, self.cout).transpose(0, 2, 1)
            np.copyto(kt.reshape(-1, self.cout, self.cin), per_tap)
            np.copyto(dzp_in, ws["dz2"].reshape(dzp_in.shape))
            native.loaded().gemm(ws["dzp"], ws["dx_rows"], ws["dx_red"], kt, ws["dx_c"], self.cin)
            return ws["dx_c"]
        kt = kernel.reshape(-1, self.cin, self.cout).transpose(0, 2, 1)
        dxp, t5, dz2, r = ws["dxp"], ws["dtaps5"], ws["dz2"], self.npos
        dxp.fill(0)
        for s, e in self._slices(ws, dxp.shape[0]):
            m = e - s
            np.matmul(dz2[s * r : e * r], kt, out=ws["dtaps"][:, : m * r])
            for n, t in enumerate(self.taps()):
                view = self.tap(dxp[s:e], *t)
                np.add(view, t5[n, :m], out=view)
        return ws["dx"]
