"""Window layers: Conv2D (any kernel, strides, 'valid'/'same') by im2col + BLAS, Max and
Average pooling, global average pooling."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ringtrain_trainer.engine.ops.window import same_pad
from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer, act_backward, act_forward


class Windows(Layer):
    """Shared geometry of Conv2D and pooling: kernel, strides, 'valid'/'same' padding."""

    def _geometry(self, in_shape, kernel, strides, padding):
        h, w, c = in_shape
        (kh, kw), (sh, sw) = kernel, strides
        if padding == "same":
            ho, pt, pb = same_pad(h, kh, sh)
            wo, pl, pr = same_pad(w, kw, sw)
        else:
            ho, wo, pt, pb, pl, pr = (h - kh) // sh + 1, (w - kw) // sw + 1, 0, 0, 0, 0
        if ho < 1 or wo < 1:
            raise ValueError(f"input {in_shape} is smaller than the {kh}x{kw} window")
        self.in_shape, self.cin, self.k, self.s = in_shape, c, (kh, kw), (sh, sw)
        self.ho, self.wo, self.pad = ho, wo, (pt, pb, pl, pr)
        self.padded = (h + pt + pb, w + pl + pr, c)

    def _win(self, xp: np.ndarray, b: int) -> np.ndarray:
        """(b, ho, wo, kh, kw, c) view of the padded input."""
        s0, s1, s2, s3 = xp.strides
        return as_strided(
            xp,
            (b, self.ho, self.wo, *self.k, self.cin),
            (s0, s1 * self.s[0], s2 * self.s[1], s1, s2, s3),
            writeable=False,
        )

    def _inner(self, xp: np.ndarray) -> np.ndarray:
        pt, _pb, pl, _pr = self.pad
        h, w, _ = self.in_shape
        return xp[:, pt : pt + h, pl : pl + w, :]

    def _scatter(self, dxp: np.ndarray, dwin: np.ndarray) -> None:
        """Add a (b, ho, wo, kh, kw, c) window gradient back onto the padded input gradient."""
        sh, sw = self.s
        for i in range(self.k[0]):
            for j in range(self.k[1]):
                view = dxp[
                    :, i : i + sh * (self.ho - 1) + 1 : sh, j : j + sw * (self.wo - 1) + 1 : sw
                ]
                np.add(view, dwin[:, :, :, i, j], out=view)


class Conv2D(Windows):
    """Conv2D with any kernel, strides and padding: im2col + one BLAS product."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        filters,
        kernel,
        strides=(1, 1),
        padding="valid",
        activation="linear",
        use_bias=True,
    ):
        self._geometry(in_shape, kernel, strides, padding)
        self.cout, self.act, self.use_bias = filters, activation, use_bias
        self.kk = kernel[0] * kernel[1] * self.cin
        self.out_shape = (self.ho, self.wo, filters)

    def params(self, layer: int) -> list[ParamSpec]:
        (kh, kw), c, f = self.k, self.cin, self.cout
        ps = [ParamSpec(layer, "kernel", (kh, kw, c, f), kh * kw * c, kh * kw * f, True)]
        return ps + ([ParamSpec(layer, "bias", (f,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        rows = b * self.ho * self.wo
        bufs = {"cols": ((rows, self.kk), "f"), "out": ((b, *self.out_shape), "f")}
        if any(self.pad):
            bufs["xp"] = ((b, *self.padded), "f")
        if train:
            bufs.update({"dz": ((b, *self.out_shape), "f"), "ones": ((rows,), "f")})
            if need_dx:
                bufs.update({"dcols": ((rows, self.kk), "f"), "dxp": ((b, *self.padded), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.ho * self.wo * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
            ws["dz2"] = ws["dz"].reshape(-1, self.cout)
        ws["cols6"] = ws["cols"].reshape(b, self.ho, self.wo, *self.k, self.cin)
        ws["out2"] = ws["out"].reshape(-1, self.cout)
        if "dxp" in ws:
            ws["dx"] = self._inner(ws["dxp"])
            ws["dcols6"] = ws["dcols"].reshape(b, self.ho, self.wo, *self.k, self.cin)

    def forward(self, ws, x, kernel, bias=None):
        xp = ws.get("xp")
        if xp is not None:
            np.copyto(self._inner(xp), x)
        else:
            xp = x
        np.copyto(ws["cols6"], self._win(xp, x.shape[0]))
        out = ws["out2"]
        np.matmul(ws["cols"], kernel.reshape(self.kk, self.cout), out=out)
        if bias is not None:
            np.add(out, bias, out=out)
        act_forward(self.act, out)
        return ws["out"]

    def backward_local(self, ws, dout):
        dz = ws["dz"]
        act_backward(self.act, ws["out"], dout.reshape(dz.shape), dz)

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
        else:
            lo, hi = rows
            g = grad.reshape(self.kk, self.cout)
            np.matmul(ws["cols"].T[lo:hi], ws["dz2"], out=g[lo:hi])

    def backward_input(self, ws, dout, kernel, bias=None):
        np.matmul(ws["dz2"], kernel.reshape(self.kk, self.cout).T, out=ws["dcols"])
        ws["dxp"].fill(0)
        self._scatter(ws["dxp"], ws["dcols6"])
        return ws["dx"]


class Pool2D(Windows):
    """MaxPooling2D / AveragePooling2D; 'same' averages count only the real pixels (as TF)."""

    def __init__(self, in_shape, kind, pool, strides, padding):
        self._geometry(in_shape, pool, strides, padding)
        self.kind_ = kind
        self.out_shape = (self.ho, self.wo, self.cin)

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f"), "xp": ((b, *self.padded), "f")}
        if self.kind_ == "avg":
            bufs["count"] = (self.out_shape, "f")
        if train and need_dx:
            bufs.update({"dxp": ((b, *self.padded), "f"), "g": ((b, *self.out_shape), "f")})
            if self.kind_ == "max":
                bufs.update(
                    {"avail": ((b, *self.out_shape), "?"), "eq": ((b, *self.out_shape), "?")}
                )
        return bufs

    def flops(self, b, train, need_dx):
        return b * self.ho * self.wo * self.cin * self.k[0] * self.k[1] * (1 + train)

    def bind(self, ws, b):
        ws["xp"].fill(-np.inf if self.kind_ == "max" else 0)
        if "count" in ws:
            ones = np.zeros((1, *self.padded), ws["count"].dtype)
            self._inner(ones)[...] = 1
            np.sum(self._win(ones, 1)[0], axis=(2, 3), out=ws["count"])
        if "dxp" in ws:
            ws["dx"] = self._inner(ws["dxp"])

    def forward(self, ws, x):
        xp = ws["xp"]
        np.copyto(self._inner(xp), x)
        win = self._win(xp, x.shape[0])
        out = ws["out"]
        if self.kind_ == "max":
            np.max(win, axis=(3, 4), out=out)
        else:
            np.sum(win, axis=(3, 4), out=out)
            np.divide(out, ws["count"], out=out)
        return out

    def backward_input(self, ws, dout):
        dxp, g = ws["dxp"], ws["g"]
        dxp.fill(0)
        b = dout.shape[0]
        dout = dout.reshape(g.shape)
        win = self._win(ws["xp"], b)
        sh, sw = self.s
        if self.kind_ == "avg":
            np.divide(dout, ws["count"], out=g)
        else:
            avail, eq = ws["avail"], ws["eq"]
            avail.fill(True)
        for i in range(self.k[0]):
            for j in range(self.k[1]):
                view = dxp[
                    :, i : i + sh * (self.ho - 1) + 1 : sh, j : j + sw * (self.wo - 1) + 1 : sw
                ]
                if self.kind_ == "max":  # the first maximal position takes it (TF's rule)
                    np.equal(win[:, :, :, i, j], ws["out"], out=eq)
                    np.logical_and(eq, avail, out=eq)
                    np.logical_xor(avail, eq, out=avail)
                    np.multiply(dout, eq, out=g)
                np.add(view, g, out=view)
        return ws["dx"]


class GlobalAvgPool2D(Layer):
    def __init__(self, in_shape):
        self.in_shape = in_shape
        self.out_shape = (in_shape[2],)
        self.n = in_shape[0] * in_shape[1]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def forward(self, ws, x):
        np.mean(x, axis=(1, 2), out=ws["out"])
        return ws["out"]

    def backward_input(self, ws, dout):
        np.multiply(dout.reshape(-1, 1, 1, self.out_shape[0]), 1.0 / self.n, out=ws["dx"])
        return ws["dx"]
