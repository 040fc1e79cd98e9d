"""Pooling, 1-D, 2-D and 3-D: Max/AveragePooling (any pool, strides, ``valid``/``same``) and
GlobalMax/GlobalAveragePooling (``keepdims``), channels last.

Gradients follow TensorFlow: a window's maximum sends its gradient to the *first* maximal
position (``MaxPoolGrad``); a global maximum splits it evenly among ties (``reduce_max``);
``same`` averages count only the real pixels under the window."""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.window import Window

KINDS = ("max", "avg")


class PoolWs(TypedDict, total=False):
    """The buffers :class:`Pool` is compiled with (``buffers``, its state, ``bind``)."""

    avail: np.ndarray
    count: np.ndarray
    dx: np.ndarray
    dxp: np.ndarray
    eq: np.ndarray
    g: np.ndarray
    out: np.ndarray
    out4: np.ndarray
    xin: np.ndarray
    xp: np.ndarray


class Pool(Window, Op):
    """Keras ``MaxPooling1D/2D/3D`` and ``AveragePooling1D/2D/3D``; ``strides=None`` is the
    pool."""

    def __init__(self, in_shape, kind: str, pool, strides=None, padding: str = "valid"):
        if kind not in KINDS:
            raise ValueError(f"pooling kind {kind!r} (supported: {KINDS})")
        if padding == "causal":
            raise ValueError("padding='causal' is for convolutions only")
        self._geometry(in_shape, pool, pool if strides is None else strides, padding)
        self.kind_ = kind
        self.out_shape = (*self.out_hw, self.cin)

    def buffers(self, b, train, need_dx):
        out4 = (b, *self.osp, self.cin)
        bufs = {"out": ((b, *self.out_shape), "f")}
        if any(self.pad):
            bufs["xp"] = ((b, *self.padded), "f")
        if self.kind_ == "avg":
            bufs["count"] = ((*self.osp, 1), "f")
        if train and need_dx:
            bufs.update({"dxp": ((b, *self.padded), "f"), "g": (out4, "f")})
            if self.kind_ == "max":
                bufs.update({"avail": (out4, "?"), "eq": (out4, "?")})
        return bufs

    def flops(self, b, train, need_dx):
        return b * self.npos * self.cin * math.prod(self.k) * (1 + train)

    def bind(self, ws: PoolWs, b):
        if "xp" in ws:
            ws["xp"].fill(-np.inf if self.kind_ == "max" else 0)
        if "count" in ws:
            ones = np.zeros((1, *self.padded[:-1], 1), ws["count"].dtype)
            self.inner(ones)[...] = 1
            np.sum(self.windows(ones)[0], axis=self._kaxes(0), out=ws["count"])
        ws["out4"] = ws["out"].reshape(b, *self.osp, self.cin)
        if "dxp" in ws:
            ws["dx"] = self.inner(ws["dxp"]).reshape(b, *self.in_shape)

    def _kaxes(self, lead: int) -> tuple[int, ...]:
        """The kernel axes of :meth:`windows`' view after ``lead`` leading axes."""
        r = len(self.osp)
        return tuple(range(lead + r, lead + 2 * r))

    def forward(self, ws: PoolWs, x):
        xp = ws.get("xp")
        if xp is None:
            xp = self.as2d(x)
        else:
            np.copyto(self.inner(xp), self.as2d(x))
        ws["xin"], win, out = xp, self.windows(xp), ws["out4"]
        if self.kind_ == "max":
            np.max(win, axis=self._kaxes(1), out=out)
        else:
            np.sum(win, axis=self._kaxes(1), out=out)
            np.divide(out, ws["count"], out=out)
        return ws["out"]

    def backward_input(self, ws: PoolWs, dout):
        dxp, g, out = ws["dxp"], ws["g"], ws["out4"]
        dxp.fill(0)
        dout = dout.reshape(g.shape)
        if self.kind_ == "avg":
            np.divide(dout, ws["count"], out=g)
        else:
            avail, eq = ws["avail"], ws["eq"]
            avail.fill(True)
        for t in self.taps():
            view = self.tap(dxp, *t)
            if self.kind_ == "max":  # the first maximal position takes it (TF's rule)
                np.equal(self.tap(ws["xin"], *t), out, out=eq)
                np.logical_and(eq, avail, out=eq)
                np.logical_xor(avail, eq, out=avail)
                np.multiply(dout, eq, out=g)
            np.add(view, g, out=view)
        return ws["dx"]


class GlobalPoolWs(TypedDict, total=False):
    """The buffers :class:`GlobalPool` is compiled with (``buffers``, its state, ``bind``)."""

    cnt: np.ndarray
    col: np.ndarray
    den: np.ndarray
    dx: np.ndarray
    dx3: np.ndarray
    eq: np.ndarray
    m: np.ndarray
    ones: np.ndarray
    out: np.ndarray
    out2: np.ndarray
    out3: np.ndarray
    x3: np.ndarray
    xm: np.ndarray


class GlobalPool(Op):
    """Keras ``GlobalMax/GlobalAveragePooling1D/2D/3D``: over every axis but batch and channels;
    ``keepdims`` keeps them as ones. ``masked`` (the 1-D average, ``engine.ops.mask``): reads
    ``(x, mask)`` and averages the unmasked timesteps only, as Keras' ``GlobalAveragePooling1D``
    (a fully masked example is NaN there too; the evaluation's zero padding rows are that).
    ``channels_first``: Keras' ``data_format="channels_first"``, the first axis the channels
    and the rest pooled (the time-series transformer of keras.io averages each timestep's
    features so); the same arithmetic on a transposed view of the input."""

    def __init__(
        self,
        in_shape,
        kind: str,
        keepdims: bool = False,
        masked: bool = False,
        channels_first: bool = False,
    ):
        if kind not in KINDS:
            raise ValueError(f"pooling kind {kind!r} (supported: {KINDS})")
        if masked and (kind != "avg" or len(in_shape) != 2 or channels_first):
            raise ValueError("a masked global pooling is the 1-D channels-last average only")
        self.masked, self.n_inputs = masked, 1 + masked
        self.in_shapes = [tuple(in_shape), tuple(in_shape[:1])][: self.n_inputs]
        self.in_shape, self.kind_, self.first = tuple(in_shape), kind, channels_first
        ones = (1,) * (len(self.in_shape) - 1)
        if channels_first:
            self.c, self.n = self.in_shape[0], math.prod(self.in_shape[1:])
            self.out_shape = (self.c, *ones) if keepdims else (self.c,)
        else:
            self.c, self.n = self.in_shape[-1], math.prod(self.in_shape[:-1])
            self.out_shape = (*ones, self.c) if keepdims else (self.c,)

    def _rows(self, a: np.ndarray) -> np.ndarray:
        """``(b, pooled positions, channels)``: a view of the input (or its gradient)."""
        if self.first:
            return a.reshape(a.shape[0], self.c, self.n).transpose(0, 2, 1)
        return a.reshape(a.shape[0], self.n, self.c)

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if self.kind_ == "avg":  # sums and spreads as stacked products (see forward)
            bufs["ones"] = ((1, self.n), "f")
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
            if self.kind_ == "avg":
                bufs["col"] = ((self.n, 1), "f")
            if self.kind_ == "max":
                bufs.update({"eq": ((b, self.n, self.c), "?"), "cnt": ((b, self.c), "f")})
        if self.masked:
            bufs.update({"xm": ((b, self.n, self.c), "f"), "den": ((b, 1, 1), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        return b * self.n * self.c * (1 + train)

    def bind(self, ws: GlobalPoolWs, b):
        ws["out2"] = ws["out"].reshape(b, self.c)
        if "ones" in ws:
            ws["ones"].fill(1)
            ws["out3"] = ws["out"].reshape(b, 1, self.c)
        if "col" in ws:
            ws["col"].fill(1.0 / self.n)
        if "dx" in ws:
            ws["dx3"] = self._rows(ws["dx"])

    def forward(self, ws: GlobalPoolWs, x, mask=None):
        ws["x3"] = x3 = self._rows(x)
        if self.masked:
            m, den = mask[..., None], ws["den"]
            np.sum(m, axis=1, keepdims=True, out=den)
            np.multiply(x3, m, out=ws["xm"])
            np.sum(ws["xm"], axis=1, out=ws["out2"])
            with np.errstate(invalid="ignore"):  # a fully masked row (an evaluation's padding)
                np.divide(ws["out2"], den[:, 0], out=ws["out2"])
            ws["m"] = m
            return ws["out"]
        if self.kind_ == "max":
            np.max(x3, axis=1, out=ws["out2"])
        else:  # np.mean's inner loop is c floats: 18x slower at (64, 144, 4) (issue 24)
            np.matmul(ws["ones"], x3, out=ws["out3"])
            np.divide(ws["out2"], self.n, out=ws["out2"])
        return ws["out"]

    def backward_input(self, ws: GlobalPoolWs, dout):
        d = dout.reshape(dout.shape[0], 1, self.c)
        if self.masked:
            with np.errstate(invalid="ignore"):
                np.divide(ws["m"], ws["den"], out=ws["xm"][..., :1])
            np.multiply(d, ws["xm"][..., :1], out=ws["dx3"])
            return ws["dx"], None
        if self.kind_ == "avg":  # (1/n) · d as a stacked rank-1 product: the same products
            np.matmul(ws["col"], d, out=ws["dx3"])
        else:  # split among ties, as reduce_max's gradient
            eq, cnt = ws["eq"], ws["cnt"]
            np.equal(ws["x3"], ws["out2"][:, None, :], out=eq)
            np.sum(eq, axis=1, out=cnt)
            np.divide(d, cnt[:, None, :], out=cnt[:, None, :])
            np.multiply(eq, cnt[:, None, :], out=ws["dx3"])
        return ws["dx"]
