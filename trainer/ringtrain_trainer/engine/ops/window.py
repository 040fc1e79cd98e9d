"""The sliding-window arithmetic every convolution and pooling op shares, written once.

Why one place: Conv1D, Conv2D, the depthwise convolutions and the poolings all need the same
three things — the output size and the padding of ``valid`` / ``same`` / ``causal`` with
strides and dilation as TensorFlow computes them, a strided *view* of the padded input with one
axis per kernel offset (im2col without a copy), and one tap's view of the input, where that
tap's gradient lands (:meth:`Window.tap`). A 1-D op is the 2-D case with a height of one, so
there is one implementation.
The arithmetic (:func:`pad_1d`) is pure Python: the Keras registry's shapes use it without
numpy (imported only inside the methods that touch arrays).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

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
    """Geometry of a window op on a channels-last input of rank 1 (``(L, C)``) or 2
    (``(H, W, C)``): kernel, strides, dilation, padding. Internally always 2-D (a 1-D input
    is one row), so views and scatters are written once."""

    def _geometry(self, in_shape, kernel, strides=1, padding="valid", dilation=1):
        in_shape = tuple(int(i) for i in in_shape)
        self.rank = rank = len(in_shape) - 1
        if rank not in (1, 2):
            raise ValueError(f"input {in_shape}: window ops take (steps, channels) or (h, w, c)")
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
        if rank == 1:  # a height-one 2-D problem
            geo, k, s, d = [(1, 0, 0), *geo], (1, *k), (1, *s), (1, *d)
        self.in_shape, self.cin = in_shape, in_shape[-1]
        self.hw = (1, in_shape[0]) if rank == 1 else in_shape[:2]
        self.k, self.s, self.d = k, s, d
        self.ho, self.wo = geo[0][0], geo[1][0]
        self.pad = (geo[0][1], geo[0][2], geo[1][1], geo[1][2])
        self.padded = (self.hw[0] + sum(self.pad[:2]), self.hw[1] + sum(self.pad[2:]), self.cin)
        self.out_hw = (self.wo,) if rank == 1 else (self.ho, self.wo)

    def as2d(self, a: np.ndarray) -> np.ndarray:
        """A (b, *in_shape) array as (b, h, w, c) (a view)."""
        return a.reshape(a.shape[0], *self.hw, a.shape[-1])

    def inner(self, xp: np.ndarray) -> np.ndarray:
        """The unpadded input inside a (b, *padded) buffer."""
        pt, _, pl, _ = self.pad
        return xp[:, pt : pt + self.hw[0], pl : pl + self.hw[1], :]

    def windows(self, xp: np.ndarray) -> np.ndarray:
        """(b, ho, wo, kh, kw, c) read-only view of the padded (b, *padded) input."""
        from numpy.lib.stride_tricks import as_strided

        s0, s1, s2, s3 = xp.strides
        (sh, sw), (dh, dw) = self.s, self.d
        return as_strided(
            xp,
            (xp.shape[0], self.ho, self.wo, *self.k, xp.shape[3]),
            (s0, s1 * sh, s2 * sw, s1 * dh, s2 * dw, s3),
            writeable=False,
        )

    def tap(self, xp: np.ndarray, i: int, j: int) -> np.ndarray:
        """(b, ho, wo, c) view of the padded input under kernel offset (i, j): what that tap
        multiplies, and where its gradient lands."""
        (sh, sw), (dh, dw) = self.s, self.d
        return xp[
            :,
            i * dh : i * dh + sh * (self.ho - 1) + 1 : sh,
            j * dw : j * dw + sw * (self.wo - 1) + 1 : sw,
        ]

    def taps(self):
        return ((i, j) for i in range(self.k[0]) for j in range(self.k[1]))
