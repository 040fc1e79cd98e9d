"""The fused fast path: Conv2D + 2x2 max-pool as one :class:`ConvPool`.

Pipeline position: ``keras_model`` uses these where a Keras model fits the fast path (and
``model.build_handwritten`` builds the seeds' CNNs from them); the general layers of this package
serve the rest. Both speak the layer protocol ``engine.program.Program`` drives (see the package
docstring).

Speed: a conv layer is always followed by a 2x2 max-pool, so :class:`ConvPool` builds its
im2col matrix in *pool-window-major* order (the four positions of each pooling window are four
contiguous blocks). Pooling is then three contiguous ``np.maximum`` calls, and bias + ReLU run
after pooling on a quarter of the data (max commutes with a per-channel bias and with ReLU).
Where the compiled kernel applies (float32, filters a multiple of 8, no input gradient: the
seeds' first layer), :class:`ConvPool` runs ``engine._native``'s fused conv-pool-ReLU instead,
which stores only the pooled output and each window's winning position (``engine.native``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import native
from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import ParamSpec


class ConvPool(Op):
    """Conv2D(k x k, 'valid', no stride) → MaxPool 2x2 (floor) → + bias → ReLU, NHWC."""

    kind = "conv"

    def __init__(self, in_shape: tuple[int, int, int], filters: int, kernel: int = 3):
        h, w, c = in_shape
        self.in_shape, self.cin, self.cout, self.k = in_shape, c, filters, kernel
        self.ho, self.wo = h - kernel + 1, w - kernel + 1
        self.hp, self.wp = self.ho // 2, self.wo // 2
        if self.hp < 1 or self.wp < 1:
            raise InvalidSpec(f"input {in_shape} too small for a {kernel}x{kernel} conv + 2x2 pool")
        self.out_shape = (self.hp, self.wp, filters)
        self.kk = kernel * kernel * c
        # With one input channel a patch row is only k*k floats, too short for a fast strided
        # copy; storing im2col transposed makes every copied run a whole image row instead.
        self.transposed = c == 1

    def params(self, layer: int) -> list[ParamSpec]:
        k, c, f = self.k, self.cin, self.cout
        return [
            ParamSpec(layer, "kernel", (k, k, c, f), k * k * c, k * k * f, True),
            ParamSpec(layer, "bias", (f,), 0, 0, False),
        ]

    def native(self, need_dx: bool) -> bool:
        """Whether the compiled kernel runs this layer (float32 is checked at ``bind``)."""
        return native.kernels is not None and self.cout % 8 == 0 and not need_dx

    def buffers(self, b: int, train: bool, need_dx: bool) -> dict[str, tuple[tuple[int, ...], str]]:
        if self.native(need_dx):
            pooled = (b, self.hp, self.wp, self.cout)
            bufs: dict[str, tuple[tuple[int, ...], str]] = {
                "out": (pooled, "f"),
                "idx": (pooled, "u"),
            }
            if train:
                bufs.update({"dw": ((self.kk, self.cout), "f"), "db": ((self.cout,), "f")})
            return bufs
        return self._numpy_buffers(b, train, need_dx)

    def _numpy_buffers(self, b: int, train: bool, need_dx: bool) -> dict:
        rows = 4 * b * self.hp * self.wp
        pooled = (b, self.hp, self.wp, self.cout)
        bufs = {
            "cols": ((self.kk, rows) if self.transposed else (rows, self.kk), "f"),
            "conv": ((rows, self.cout), "f"),
            "pooled": (pooled, "f"),
            "out": (pooled, "f"),
        }
        if native.kernels is not None and self.cout % 8 == 0:  # pool_relu's winners
            bufs["win"] = (pooled, "u")
        if train:
            bufs.update(
                {
                    "mask": (pooled, "?"),
                    "eq": (pooled, "?"),
                    "dconv": ((rows, self.cout), "f"),
                    "ones": ((rows,), "f"),
                }
            )
            if need_dx and native.kernels is not None and self.cin % 8 == 0:
                k, cin, f = self.k, self.cin, self.cout
                bufs.update(
                    {
                        "win": (pooled, "u"),  # the input gradient's winners (any filters)
                        "kernel_t": ((k, k, f, cin), "f"),
                        "dx": ((b, *self.in_shape), "f"),
                    }
                )
            elif need_dx:
                bufs.update({"dcols": ((rows, self.kk), "f"), "dx": ((b, *self.in_shape), "f")})
        return bufs

    def flops(self, b: int, train: bool, need_dx: bool) -> int:
        mm = 2 * 4 * b * self.hp * self.wp * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: dict[str, Any], b: int) -> None:
        """Precompute the strided views used every step (once per compile). A program in
        another dtype than float32 (the gradient checks' float64) runs the numpy path."""
        f32 = ws["out"].dtype == np.float32
        ws["native"], ws["native_dx"] = "idx" in ws and f32, "kernel_t" in ws and f32
        if ws["native"]:
            return
        #: pooling, bias and ReLU compiled over the conv's output, and its gradient routed back
        #: by each window's winner (pool_relu / unpool): the numpy passes below otherwise
        ws["pool_native"] = "win" in ws and f32 and self.cout % 8 == 0
        ws["gemm"] = not self.transposed and native.gemm_runs(self.cout, ws["out"].dtype)
        if ws["gemm"]:  # the product reads the input in place: pixels x taps offset tables
            h, w, c = self.in_shape
            ws["pixels"] = native.offsets(
                (2, w * c), (2, c), (b, h * w * c), (self.hp, 2 * w * c), (self.wp, 2 * c)
            )
            ws["taps"] = native.offsets((self.k, w * c), (self.k, c), (c, 1))
        if "idx" in ws:
            for k, (shape, t) in self._numpy_buffers(b, "dw" in ws, False).items():
                if k not in ws:
                    ws[k] = np.zeros(shape, ws["out"].dtype if t == "f" else np.bool_)
        if "win" in ws and not ws["native_dx"]:
            ws["dcols"] = np.zeros((ws["conv"].shape[0], self.kk), ws["out"].dtype)
        ws["conv4"] = ws["conv"].reshape(4, b, self.hp, self.wp, self.cout)
        if "dconv" in ws:
            ws["dconv4"] = ws["dconv"].reshape(4, b, self.hp, self.wp, self.cout)
            ws["ones"].fill(1)
        if self.transposed:
            ws["colsv"] = ws["cols"].reshape(self.k, self.k, 2, 2, b, self.hp, self.wp)
            ws["A"] = ws["cols"].T
        else:
            ws["colsv"] = ws["cols"].reshape(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin)
            ws["A"] = ws["cols"]
        if "dcols" in ws:
            ws["dcols8"] = ws["dcols"].reshape(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin)

    def _dims(self, x: np.ndarray) -> tuple[int, ...]:
        return (x.shape[0], *self.in_shape, self.k, self.cout)

    def _windows(self, x: np.ndarray, b: int) -> np.ndarray:
        """(di, dj, b, i, j, ki, kj, c) view: input pixel (2i+di+ki, 2j+dj+kj) of image b
        (axes (ki, kj, di, dj, b, i, j) when transposed)."""
        sb, sh, sw, sc = x.strides
        if self.transposed:
            return as_strided(
                x,
                shape=(self.k, self.k, 2, 2, b, self.hp, self.wp),
                strides=(sh, sw, sh, sw, sb, 2 * sh, 2 * sw),
                writeable=False,
            )
        return as_strided(
            x,
            shape=(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin),
            strides=(sh, sw, sb, 2 * sh, 2 * sw, sh, sw, sc),
            writeable=False,
        )

    def forward(
        self, ws: dict[str, Any], x: np.ndarray, kernel: np.ndarray, bias: np.ndarray
    ) -> np.ndarray:
        if ws["native"]:
            out = ws["out"]
            native.loaded().convpool_forward(x, kernel, bias, out, ws["idx"], *self._dims(x))
            ws["x"] = x
            return out
        if ws["gemm"]:
            ws["x"] = x
            kern = kernel.reshape(self.kk, self.cout)
            native.loaded().gemm(x, ws["pixels"], ws["taps"], kern, ws["conv"], self.cout)
        else:
            if ws.get("windows_of") is not x:  # the input buffer is fixed per program
                ws["windows"], ws["windows_of"] = self._windows(x, x.shape[0]), x
            np.copyto(ws["colsv"], ws["windows"])
            np.matmul(ws["A"], kernel.reshape(self.kk, self.cout), out=ws["conv"])
        if ws["pool_native"]:
            out, p = ws["out"], ws["out"].size // self.cout
            native.loaded().pool_relu(ws["conv"], bias, out, ws["win"], p, self.cout)
            return out
        c4, pooled, out = ws["conv4"], ws["pooled"], ws["out"]
        np.maximum(c4[0], c4[1], out=pooled)
        np.maximum(pooled, c4[2], out=pooled)
        np.maximum(pooled, c4[3], out=pooled)
        np.add(pooled, bias, out=out)
        np.maximum(out, 0, out=out)
        return out

    def backward_local(self, ws: dict[str, Any], dout: np.ndarray) -> None:
        """Route each window's gradient to its first maximal position (TensorFlow's tie rule)
        where the ReLU passed it; ``avail`` marks windows not yet claimed. Masks are bool, so
        the only float passes are the four products."""
        if ws["native"]:
            x = ws["x"]
            native.loaded().convpool_backward(
                x, dout, ws["idx"], ws["dw"], ws["db"], *self._dims(x)
            )
            return
        if ws["pool_native"]:
            d, p = np.ascontiguousarray(dout), ws["out"].size // self.cout
            native.loaded().unpool(d, ws["win"], ws["dconv"], p, self.cout)
            return
        c4, d4, pooled = ws["conv4"], ws["dconv4"], ws["pooled"]
        avail, eq = ws["mask"], ws["eq"]
        d = dout.reshape(pooled.shape)
        np.greater(ws["out"], 0, out=avail)
        win = ws["win"] if ws["native_dx"] else None
        if win is not None:  # each window's winner, for the compiled input gradient
            win.fill(4)
        for k in range(3):
            np.equal(c4[k], pooled, out=eq)
            np.logical_and(eq, avail, out=eq)
            np.multiply(d, eq, out=d4[k])
            np.logical_xor(avail, eq, out=avail)
            if win is not None:
                np.copyto(win, k, where=eq)
        np.multiply(d, avail, out=d4[3])
        if win is not None:
            np.copyto(win, 3, where=avail)

    def backward_weights(
        self,
        ws: dict[str, Any],
        dout: np.ndarray,
        name: str,
        grad: np.ndarray,
        rows: tuple[int, int],
    ) -> None:
        if ws["native"]:
            lo, hi = rows if name == "kernel" else (0, 1)
            src = ws["dw"] if name == "kernel" else ws["db"].reshape(1, -1)
            np.copyto(grad.reshape(src.shape)[lo:hi], src[lo:hi])
            return
        if name == "bias":
            # a column sum as a matrix-vector product: BLAS is ~10x faster than add.reduce here
            np.matmul(ws["ones"], ws["dconv"], out=grad)
        else:
            lo, hi = rows
            g = grad.reshape(self.kk, self.cout)
            if ws["gemm"]:
                taps = ws["taps"][lo:hi]
                native.loaded().gemm(ws["x"], taps, ws["pixels"], ws["dconv"], g[lo:hi], self.cout)
            else:
                np.matmul(ws["A"].T[lo:hi], ws["dconv"], out=g[lo:hi])

    def backward_input(
        self, ws: dict[str, Any], dout: np.ndarray, kernel: np.ndarray, bias: np.ndarray
    ) -> np.ndarray:
        if ws["native_dx"]:
            kt, dx = ws["kernel_t"], ws["dx"]
            np.copyto(kt, kernel.transpose(0, 1, 3, 2))
            native.loaded().convpool_input_grad(kt, dout, ws["win"], dx, *self._dims(dx))
            return dx
        np.matmul(ws["dconv"], kernel.reshape(self.kk, self.cout).T, out=ws["dcols"])
        dx, dc = ws["dx"], ws["dcols8"]
        dx.fill(0)
        h2, w2 = 2 * self.hp, 2 * self.wp
        for di in range(2):
            for dj in range(2):
                for ki in range(self.k):
                    for kj in range(self.k):
                        r, c = di + ki, dj + kj
                        view = dx[:, r : r + h2 : 2, c : c + w2 : 2, :]
                        np.add(view, dc[di, dj, :, :, :, ki, kj, :], out=view)
        return dx
