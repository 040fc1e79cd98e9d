"""The sliding-window arithmetic every convolution and pooling op shares, written once.

Why one place: Conv1D, Conv2D, the depthwise convolutions and the poolings all need the same
three things — the output size and the padding of ``valid`` / ``same`` / ``causal`` with
strides and dilation as TensorFlow computes them, a strided *view* of the padded input with one
axis per kernel offset (im2col without a copy), and one tap's view of the input, where that
tap's gradient lands (:meth:`Window.tap`). A 1-D op is the 2-D case with a height of one, and
the views take any number of spatial axes (Conv3D), so there is one implementation.
The arithmetic (:func:`pad_1d`) is pure Python; the Keras registry's shape inference uses it
(``keras.layers_window``), so "same" padding is computed in this one place.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

PADDINGS = ("valid", "same", "causal")


def pad_1d(n: int, k: int, s: int = 1, d: int = 1, padding: str = "valid"):
    """(output size, pad before, pad after) of one axis of length ``n``, kernel ``k``, stride
    ``s``, dilation ``d``, as TensorFlow pads: ``same`` puts the odd pixel after, ``causal``
    (Conv1D) pads only before."""
    span = (k - 1) * d + 1
    if padding == "same":
        out = -(-n // s)
        total = max((out - 1) * s + span - n, 0)
        return out, total // 2, total - total // 2
    if padding == "causal":
        return (n - 1) // s + 1, span - 1, 0
    if padding != "valid":
        raise ValueError(f"padding={padding!r} is not supported (supported: {PADDINGS})")
    return (n - span) // s + 1, 0, 0


def same_pad(n: int, k: int, s: int) -> tuple[int, int, int]:
    """(output size, pad before, pad after) of TensorFlow's 'same' padding."""
    return pad_1d(n, k, s, 1, "same")


def pair(v, rank: int, what: str) -> tuple[int, ...]:
    """An int or a tuple of ``rank`` ints (Keras' ``kernel_size=3`` or ``(3, 3)``)."""
    t = (int(v),) * rank if isinstance(v, int) else tuple(int(i) for i in v)
    if len(t) != rank or min(t) < 1:
        raise ValueError(f"{what}={v!r}: expected {rank} positive integer(s)")
    return t


class Window:
    """Geometry of a window op on a channels-last input of rank 1 (``(L, C)``), 2
    (``(H, W, C)``) or 3 (``(D, H, W, C)``, Conv3D and the 3-D poolings): kernel, strides,
    dilation, padding. Internally at least 2-D (a 1-D input is one row), so views and scatters
    are written once for every rank; ``sp``/``osp`` are the internal input/output spatial
    shapes, ``npos`` the output positions per example. ``ho``, ``wo`` and the 4-tuple ``pad``
    are the last two axes' (what the 1-D/2-D-only ops read)."""

    def _geometry(self, in_shape, kernel, strides=1, padding="valid", dilation=1):
        in_shape = tuple(int(i) for i in in_shape)
        self.rank = rank = len(in_shape) - 1
        if rank not in (1, 2, 3):
            raise ValueError(
                f"input {in_shape}: window ops take (steps, channels), (h, w, c) or (d, h, w, c)"
            )
        k, s, d = (
            pair(v, rank, w)
            for v, w in ((kernel, "kernel"), (strides, "strides"), (dilation, "dilation_rate"))
        )
        if padding == "causal" and rank != 1:
            raise ValueError("padding='causal' is for 1-D inputs only")
        geo = [
            pad_1d(n, kn, sn, dn, padding)
            for n, kn, sn, dn in zip(in_shape[:-1], k, s, d, strict=True)
        ]
        if min(g[0] for g in geo) < 1:
            raise ValueError(f"input {in_shape} is smaller than the {k} window")
        sp = in_shape[:-1]
        if rank == 1:  # a height-one 2-D problem
            geo, k, s, d, sp = [(1, 0, 0), *geo], (1, *k), (1, *s), (1, *d), (1, *sp)
        self.in_shape, self.cin = in_shape, in_shape[-1]
        self.sp, self.osp = sp, tuple(g[0] for g in geo)
        self.npos = math.prod(self.osp)
        self.hw = sp[-2:]
        self.k, self.s, self.d = k, s, d
        self.ho, self.wo = self.osp[-2:]
        self.pad = tuple(p for g in geo for p in g[1:])
        self.padded = (*(n + g[1] + g[2] for n, g in zip(sp, geo, strict=True)), self.cin)
        self.out_hw = self.osp[1:] if rank == 1 else self.osp

    def as2d(self, a: np.ndarray) -> np.ndarray:
        """A (b, *in_shape) array as (b, *sp, c) (a view; (b, h, w, c) below 3-D)."""
        return a.reshape(a.shape[0], *self.sp, a.shape[-1])

    def inner(self, xp: np.ndarray) -> np.ndarray:
        """The unpadded input inside a (b, *padded) buffer."""
        cut = (slice(p, p + n) for p, n in zip(self.pad[::2], self.sp, strict=True))
        return xp[(slice(None), *cut)]

    def windows(self, xp: np.ndarray) -> np.ndarray:
        """(b, *osp, *k, c) read-only view of the padded (b, *padded) input."""
        st = xp.strides[1:-1]
        return as_strided(
            xp,
            (xp.shape[0], *self.osp, *self.k, xp.shape[-1]),
            (
                xp.strides[0],
                *(a * b for a, b in zip(st, self.s, strict=True)),
                *(a * b for a, b in zip(st, self.d, strict=True)),
                xp.strides[-1],
            ),
            writeable=False,
        )

    def tap(self, xp: np.ndarray, *t: int) -> np.ndarray:
        """(b, *osp, c) view of the padded input under kernel offset ``t`` (one index per
        axis): what that tap multiplies, and where its gradient lands."""
        cut = (
            slice(i * d, i * d + s * (o - 1) + 1, s)
            for i, d, s, o in zip(t, self.d, self.s, self.osp, strict=True)
        )
        return xp[(slice(None), *cut)]

    def taps(self):
        return itertools.product(*(range(k) for k in self.k))
