"""Ops that move values without arithmetic, 1-D, 2-D and 3-D, channels last: ZeroPadding and
Cropping (one :class:`Border` op: the smaller tensor is a window of the larger) and nearest
UpSampling. Each copies into its own planned buffer, so what follows reads a contiguous tensor
(a view would make the next reshape copy every step)."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op


def borders(spec, rank: int, what: str) -> tuple[tuple[int, int], ...]:
    """Keras' ``padding`` / ``cropping`` argument → ((before, after),) per spatial axis: an int
    (all sides), a pair (1-D: before/after; 2-D: symmetric per axis) or a pair of pairs."""
    if isinstance(spec, int):
        out = ((spec, spec),) * rank
    elif rank == 1 and len(spec) == 2 and all(isinstance(v, int) for v in spec):
        out = (tuple(spec),)
    elif all(isinstance(v, int) for v in spec):
        out = tuple((v, v) for v in spec)
    else:
        out = tuple(tuple(v) for v in spec)
    if len(out) != rank or any(len(p) != 2 or min(p) < 0 for p in out):
        raise ValueError(f"{what}={spec!r}: expected {rank} non-negative (before, after) pairs")
    return tuple((int(a), int(b)) for a, b in out)


class BorderWs(TypedDict, total=False):
    """The buffers :class:`Border` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray


class Border(Op):
    """Keras ``ZeroPadding1D/2D/3D`` (``mode='pad'``) and ``Cropping1D/2D/3D``
    (``mode='crop'``)."""

    def __init__(self, in_shape, sides, mode: str):
        self.in_shape = tuple(in_shape)
        rank = len(self.in_shape) - 1
        self.sides, self.mode = (
            borders(sides, rank, "cropping" if mode == "crop" else "padding"),
            mode,
        )
        sign = 1 if mode == "pad" else -1
        spatial = tuple(
            n + sign * (a + b) for n, (a, b) in zip(self.in_shape, self.sides, strict=False)
        )
        if min(spatial) < 1:
            raise ValueError(f"cropping {self.sides} leaves nothing of input {self.in_shape}")
        self.out_shape = (*spatial, self.in_shape[-1])
        small = self.in_shape if mode == "pad" else self.out_shape
        self.window = tuple(
            slice(a, a + n) for (a, _), n in zip(self.sides, small[:-1], strict=False)
        )

    def _inner(self, big):
        return big[(slice(None), *self.window)]

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def bind(self, ws: BorderWs, b):
        ws["out"].fill(0)
        if "dx" in ws:
            ws["dx"].fill(0)

    def forward(self, ws: BorderWs, x):
        if self.mode == "pad":  # the border stays as bind's zeros
            np.copyto(self._inner(ws["out"]), x)
        else:
            np.copyto(ws["out"], self._inner(x))
        return ws["out"]

    def backward_input(self, ws: BorderWs, dout):
        dout = dout.reshape(ws["out"].shape)
        if self.mode == "pad":
            np.copyto(ws["dx"], self._inner(dout))
        else:  # the cropped border's gradient stays zero
            np.copyto(self._inner(ws["dx"]), dout)
        return ws["dx"]


class UpSamplingWs(TypedDict, total=False):
    """The buffers :class:`UpSampling` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray


class UpSampling(Op):
    """Keras ``UpSampling1D`` (``size``), ``UpSampling2D`` (``size``, nearest) and
    ``UpSampling3D``: every value repeated ``size`` times along each spatial axis."""

    def __init__(self, in_shape, size):
        self.in_shape = tuple(in_shape)
        rank = len(self.in_shape) - 1
        size = (size,) * rank if isinstance(size, int) else tuple(size)
        if rank not in (1, 2, 3) or len(size) != rank or min(size) < 1:
            raise ValueError(f"UpSampling size={size!r} for input {self.in_shape}")
        self.size = size
        self.hw = self.in_shape[:-1]
        self.out_shape = (
            *(n * s for n, s in zip(self.in_shape, size, strict=False)),
            self.in_shape[-1],
        )

    def _six(self, a):
        """(b, h, sh, w, sw, c) view of an output-shaped array (every spatial axis and its
        repeat)."""
        pairs = (v for n, s in zip(self.hw, self.size, strict=True) for v in (n, s))
        return a.reshape(a.shape[0], *pairs, a.shape[-1])

    @property
    def _reps(self) -> tuple[int, ...]:
        """The repeat axes of :meth:`_six`'s view."""
        return tuple(range(2, 2 * len(self.hw) + 1, 2))

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def forward(self, ws: UpSamplingWs, x):
        x4 = x.reshape(x.shape[0], *self.hw, x.shape[-1])
        np.copyto(self._six(ws["out"]), np.expand_dims(x4, self._reps))
        return ws["out"]

    def backward_input(self, ws: UpSamplingWs, dout):
        dx = ws["dx"]
        d4 = dx.reshape(dx.shape[0], *self.hw, dx.shape[-1])
        np.sum(self._six(dout.reshape(ws["out"].shape)), axis=self._reps, out=d4)
        return dx


class ReshapeWs(TypedDict, total=False):
    """The buffers :class:`Reshape` is compiled with (``buffers``, its state, ``bind``)."""

    out: np.ndarray
    src: np.ndarray


class Reshape(Op):
    """Flatten and Reshape: a view, no copy (NHWC is already row-major like Keras)."""

    def __init__(self, in_shape, out_shape):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def buffers(self, b, train, need_dx):
        return {}

    def forward(self, ws: ReshapeWs, x):
        if ws.get("src") is not x:  # a fixed buffer per program: the same view every step
            ws["out"], ws["src"] = x.reshape((x.shape[0], *self.out_shape)), x
        return ws["out"]

    def backward_input(self, ws: ReshapeWs, dout):
        return dout.reshape((dout.shape[0], *self.in_shape))
