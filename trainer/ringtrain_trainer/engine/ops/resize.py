"""Keras ``Resizing`` (``keras.ops.image.resize``, TensorFlow's ``tf.image.resize``): bilinear
with half-pixel centres and no antialiasing, or nearest. Both are separable, so the op holds one
small interpolation matrix per spatial axis (``A_h``: out_h × in_h, ``A_w``: out_w × in_w) and
runs two batched matmuls; its backward is the same two matmuls with the transposes. Unlike the
augmentation layers it is active at inference, so it is an ordinary op anywhere in the graph."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

INTERPOLATIONS = ("bilinear", "nearest")


def interpolation_matrix(n_in: int, n_out: int, mode: str) -> np.ndarray:
    """Row ``o`` holds the weights of the inputs that output ``o`` reads, as TensorFlow's
    ``ResizeBilinear``/``ResizeNearestNeighbor`` with ``half_pixel_centers`` compute them:
    bilinear samples ``(o + 0.5) * scale - 0.5`` clamped to the edge, nearest takes
    ``floor((o + 0.5) * scale)``."""
    scale = n_in / n_out
    a = np.zeros((n_out, n_in), np.float64)
    rows = np.arange(n_out)
    centre = (rows + 0.5) * scale
    if mode == "nearest":
        a[rows, np.minimum(np.floor(centre).astype(int), n_in - 1)] = 1.0
        return a
    if mode != "bilinear":
        raise ValueError(f"interpolation={mode!r} (supported: {', '.join(INTERPOLATIONS)})")
    src = centre - 0.5
    low = np.floor(src)
    frac = src - low
    lo = np.clip(low.astype(int), 0, n_in - 1)
    hi = np.clip(np.ceil(src).astype(int), 0, n_in - 1)
    np.add.at(a, (rows, lo), 1.0 - frac)
    np.add.at(a, (rows, hi), frac)
    return a


class ResizeWs(TypedDict, total=False):
    """The buffers :class:`Resize` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray
    rows: np.ndarray


class Resize(Op):
    """``(H, W, C)`` → ``(height, width, C)``: ``out = A_h · x · A_wᵀ`` per example and channel."""

    def __init__(self, in_shape, height: int, width: int, mode: str = "bilinear"):
        self.in_shape = tuple(in_shape)
        if len(self.in_shape) != 3:
            raise ValueError(f"Resizing needs an (H, W, C) input, got {self.in_shape}")
        h_in, w_in, c = self.in_shape
        self.out_shape = (int(height), int(width), c)
        self.mats = {
            np.dtype(np.float64): (
                interpolation_matrix(h_in, height, mode),
                interpolation_matrix(w_in, width, mode),
            )
        }

    def _mats(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        dtype = np.dtype(dtype)
        if dtype not in self.mats:  # once per dtype, not per step
            ah, aw = self.mats[np.dtype(np.float64)]
            self.mats[dtype] = (ah.astype(dtype), aw.astype(dtype))
        return self.mats[dtype]

    def buffers(self, b, train, need_dx):
        bufs = self.out_and_dx(b, train, need_dx)
        _, w_in, c = self.in_shape
        bufs["rows"] = ((b, self.out_shape[0], w_in, c), "f")  # A_h applied, A_w not yet
        return bufs

    def flops(self, b, train, need_dx):
        (h_in, w_in, c), (h, w, _) = self.in_shape, self.out_shape
        once = 2 * b * c * (h * h_in * w_in + h * w * w_in)
        return once * (2 if train and need_dx else 1)

    def forward(self, ws: ResizeWs, x):
        ah, aw = self._mats(x.dtype)
        b = x.shape[0]
        (h_in, w_in, c), (h, w, _) = self.in_shape, self.out_shape
        rows = ws["rows"]
        np.matmul(ah, x.reshape(b, h_in, w_in * c), out=rows.reshape(b, h, w_in * c))
        np.matmul(aw, rows.reshape(b * h, w_in, c), out=ws["out"].reshape(b * h, w, c))
        return ws["out"]

    def backward_input(self, ws: ResizeWs, dout):
        ah, aw = self._mats(dout.dtype)
        b = dout.shape[0]
        (h_in, w_in, c), (h, w, _) = self.in_shape, self.out_shape
        rows = ws["rows"]
        np.matmul(aw.T, dout.reshape(b * h, w, c), out=rows.reshape(b * h, w_in, c))
        np.matmul(ah.T, rows.reshape(b, h, w_in * c), out=ws["dx"].reshape(b, h_in, w_in * c))
        return ws["dx"]
