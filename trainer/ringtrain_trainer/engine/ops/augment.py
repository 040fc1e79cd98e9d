"""Keras' image augmentation layers that ringtrain runs: ``RandomFlip``, ``RandomRotation``,
``RandomTranslation``, ``RandomZoom``.
Training only (the identity in predict and in the export, as Keras' ``training=False``). Both
are linear in the image, so they have a backward and may sit anywhere.

Keras 3.15's draw: one uniform per image, ``u <= 0.5`` flips it — along the width
("horizontal"), the height ("vertical"), or both at once ("horizontal_and_vertical": the same
draw for both axes, as ``RandomFlip._flip_inputs`` applies it). The draw is keyed like
``Dropout``'s masks (Philox on (--seed, layer) at counter (step, global example)): a new draw
each step, the same for any worker count.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

FLIP_MODES = ("horizontal", "vertical", "horizontal_and_vertical")


class RandomFlipWs(TypedDict, total=False):
    """The buffers :class:`RandomFlip` is compiled with (``buffers``, its state, ``bind``)."""

    ctx: dict[str, Any]
    dx: np.ndarray
    flips: np.ndarray
    out: np.ndarray


class RandomFlip(Op):
    def __init__(self, shape, mode: str, layer_index: int):
        if mode not in FLIP_MODES or len(shape) != 3:
            raise ValueError(f"RandomFlip needs (H, W, C) and a mode of {FLIP_MODES}")
        self.in_shape = self.out_shape = tuple(shape)
        self.mode, self.index = mode, layer_index
        self.axes = {"horizontal": (1,), "vertical": (0,)}.get(mode, (0, 1))

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        own = {"out": (shape, "f"), "flips": ((b,), "b")}
        return {**own, "dx": (shape, "f")} if need_dx else own

    def forward(self, ws: RandomFlipWs, x):
        if "flips" not in ws:
            return x
        ctx, out, flips = ws["ctx"], ws["out"], ws["flips"]
        for e in range(len(x)):
            bits = np.random.Philox(
                key=[ctx["seed"] & (2**64 - 1), self.index],
                counter=[0, 0, ctx["step"], ctx["example0"] + e],
            )
            flips[e] = np.random.Generator(bits).random(dtype=np.float32) <= 0.5
            np.copyto(out[e], np.flip(x[e], self.axes) if flips[e] else x[e])
        return out

    def backward_input(self, ws: RandomFlipWs, dout):
        if "flips" not in ws:
            return dout
        dx, dout = ws["dx"], dout.reshape(ws["dx"].shape)
        for e, flipped in enumerate(ws["flips"]):
            np.copyto(dx[e], np.flip(dout[e], self.axes) if flipped else dout[e])
        return dx


FILL_MODES = ("reflect", "wrap", "constant", "nearest")
INTERPOLATIONS = ("bilinear", "nearest")


def _map(c: np.ndarray, n: int, mode: str) -> np.ndarray:
    """TensorFlow's ``ImageProjectiveTransformV3`` coordinate map for a fill mode (what
    Keras' ``ops.image.affine_transform`` runs), in place on ``c``."""
    if mode == "constant":
        return c
    if n <= 1:
        c[:] = 0
        return c
    if mode == "reflect":
        s2 = 2 * n
        lo = c < 0
        big = lo & (c < -s2)
        c[big] += s2 * np.trunc(-c[big] / s2)
        c[lo] = np.where(c[lo] < -n, c[lo] + s2, -c[lo] - 1)
        hi = c > n - 1
        c[hi] -= s2 * np.trunc(c[hi] / s2)
        c[hi] = np.where(c[hi] >= n, s2 - c[hi] - 1, c[hi])
    elif mode == "wrap":
        lo, hi = c < 0, c > n - 1
        c[lo] += n * (np.trunc(-c[lo] / (n - 1)) + 1)
        c[hi] -= n * np.trunc(c[hi] / (n - 1))
    return np.clip(c, 0, n - 1, out=c)


class RandomAffineWs(TypedDict, total=False):
    """The buffers :class:`RandomAffine` is compiled with (``buffers``, its state, ``bind``)."""

    ctx: dict[str, Any]
    dx: np.ndarray
    matrix: np.ndarray
    out: np.ndarray


class RandomAffine(Op):
    """Keras 3's ``RandomRotation`` (``kind`` "rotation": per image an angle uniform in
    ``factor`` × 360°, about the image centre, ``_compute_affine_matrix``) and
    ``RandomTranslation`` ("translation": per image a height then a width shift uniform in
    the factors × the side, the matrix ``[1 0 -dx; 0 1 -dy]``) and ``RandomZoom`` ("zoom":
    per image a height then a width zoom ``1 + U(factor)``, one draw for both without a width
    factor, about the centre), sampled as TensorFlow's affine
    transform samples (``fill_mode``, ``interpolation``, ``fill_value``). Training only. The
    sampling is linear in the image: the backward scatters the upstream gradient back through
    the same taps. ``ws["matrix"]`` holds each image's drawn transform (Keras' 8 numbers)."""

    def __init__(self, shape, kind, factors, fill_mode, interpolation, fill_value, layer_index):
        if len(shape) != 3 or fill_mode not in FILL_MODES or interpolation not in INTERPOLATIONS:
            raise ValueError(f"{kind} needs (H, W, C), a fill mode and an interpolation")
        if kind not in ("rotation", "translation", "zoom"):
            raise ValueError(f"unknown affine augmentation {kind!r}")
        self.in_shape = self.out_shape = tuple(shape)
        self.kind, self.factors = kind, [(float(lo), float(hi)) for lo, hi in factors]
        self.fill_mode, self.interpolation = fill_mode, interpolation
        self.fill_value, self.index = float(fill_value), layer_index
        h, w = shape[0], shape[1]
        self.rows, self.cols = np.mgrid[0:h, 0:w].astype(np.float64)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        own = {"out": (shape, "f"), "matrix": ((b, 8), "f")}
        return {**own, "dx": (shape, "f")} if need_dx else own

    def _draw(self, g: np.random.Generator, m: np.ndarray) -> None:
        u = g.random(len(self.factors), dtype=np.float32)
        v = [lo + (hi - lo) * float(x) for (lo, hi), x in zip(self.factors, u, strict=True)]
        h, w = self.in_shape[0], self.in_shape[1]
        m[:] = 0
        if self.kind == "zoom":  # one draw for both sides when there is one factor
            zy, zx = 1.0 + v[0], 1.0 + v[-1]
            m[0], m[4] = zx, zy
            m[2], m[5] = (w - 1) / 2 * (1 - m[0]), (h - 1) / 2 * (1 - m[4])
            return
        if self.kind == "translation":
            m[[0, 4]] = 1
            m[2], m[5] = -np.float32(v[1] * w), -np.float32(v[0] * h)
            return
        t = np.float32(v[0] * 360.0) * np.float32(np.pi / 180.0)
        cos, sin = float(np.cos(t)), float(np.sin(t))
        cx, cy = 0.5 * (w - 1), 0.5 * (h - 1)
        m[:6] = [cos, -sin, cx - cx * cos + cy * sin, sin, cos, cy - cx * sin - cy * cos]

    def forward(self, ws: RandomAffineWs, x):
        if "matrix" not in ws:
            return x
        ctx, out, matrix = ws["ctx"], ws["out"], ws["matrix"]
        for e in range(len(x)):
            bits = np.random.Philox(
                key=[ctx["seed"] & (2**64 - 1), self.index],
                counter=[0, 0, ctx["step"], ctx["example0"] + e],
            )
            self._draw(np.random.Generator(bits), matrix[e])
            self._sample(x[e], matrix[e], out[e])
        return out

    def _taps(self, m: np.ndarray):
        """The samples of transform ``m``: per tap (flat source index, in-bounds mask,
        weight), each shaped (H, W); ``out = Σ weight · (in bounds ? x[index] : fill)``."""
        h, w = self.in_shape[0], self.in_shape[1]
        a0, a1, a2, b0, b1, b2 = (float(v) for v in m[:6])
        sx = _map(a0 * self.cols + a1 * self.rows + a2, w, self.fill_mode)
        sy = _map(b0 * self.cols + b1 * self.rows + b2, h, self.fill_mode)

        def tap(yy, xx, weight):
            ok = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            flat = np.clip(yy, 0, h - 1).astype(np.intp) * w + np.clip(xx, 0, w - 1).astype(np.intp)
            return flat, ok, weight

        if self.interpolation == "nearest":
            rnd = lambda c: np.sign(c) * np.floor(np.abs(c) + 0.5)  # noqa: E731 (std::round)
            return [tap(rnd(sy), rnd(sx), np.ones_like(sx))]
        y0, x0 = np.floor(sy), np.floor(sx)
        wy, wx = sy - y0, sx - x0
        return [
            tap(y0, x0, (1 - wy) * (1 - wx)),
            tap(y0, x0 + 1, (1 - wy) * wx),
            tap(y0 + 1, x0, wy * (1 - wx)),
            tap(y0 + 1, x0 + 1, wy * wx),
        ]

    def _sample(self, img: np.ndarray, m: np.ndarray, out: np.ndarray) -> None:
        flat_img = img.reshape(-1, img.shape[-1])
        acc = np.zeros(out.shape, np.float64)
        for flat, ok, weight in self._taps(m):
            v = np.where(ok[..., None], flat_img[flat], self.fill_value)
            acc += weight[..., None] * v
        out[:] = acc

    def backward_input(self, ws: RandomAffineWs, dout):
        if "matrix" not in ws:
            return dout
        dx, dout = ws["dx"], dout.reshape(ws["dx"].shape)
        dx.fill(0)
        c = self.in_shape[-1]
        for e, m in enumerate(ws["matrix"]):
            flat_dx = dx[e].reshape(-1, c)
            for flat, ok, weight in self._taps(m):
                contrib = (weight * ok)[..., None] * dout[e]
                np.add.at(flat_dx, flat.reshape(-1), contrib.reshape(-1, c))
        return dx
