"""Keras 3's ``RandomBrightness`` and ``RandomContrast``: per image one factor, then the
result clipped to ``value_range``. Training only (the identity in predict and the export, as
Keras' ``training=False``); affine in the image before the clip, so they have a backward and may
sit anywhere.

Keras 3.15's draws (``get_random_transformation``): brightness adds
``U(factor) × (high - low)`` to every value of the image; contrast draws
``a = U(1 - lower, 1 + upper)`` and maps each channel to ``(x - mean_hw) · a + mean_hw``. The
draw is keyed like the other augmentation layers' (Philox on (--seed, layer) at counter (step,
global example)): a new draw each step, the same for any worker count.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

KINDS = ("brightness", "contrast")


class RandomPixelWs(TypedDict, total=False):
    """The buffers :class:`RandomPixel` is compiled with (``buffers``, its state, ``bind``)."""

    ctx: dict[str, Any]
    dx: np.ndarray
    factor: np.ndarray
    kept: np.ndarray
    out: np.ndarray


class RandomPixel(Op):
    """``kind`` "brightness" or "contrast"; ``bounds``: the uniform's (min, max) as Keras draws
    it (brightness: ``factor``, contrast: ``(1 - lower, 1 + upper)``). ``ws["factor"]`` holds
    each image's draw (brightness: already scaled to the value range)."""

    def __init__(self, shape, kind: str, bounds, value_range, layer_index: int):
        if len(shape) != 3 or kind not in KINDS:
            raise ValueError(f"Random{kind.title()} needs (H, W, C) images")
        self.in_shape = self.out_shape = tuple(shape)
        self.kind, self.index = kind, layer_index
        self.lo, self.hi = (float(v) for v in bounds)
        self.low, self.high = (float(v) for v in value_range)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        own = {"out": (shape, "f"), "factor": ((b,), "f"), "kept": (shape, "b")}
        return {**own, "dx": (shape, "f")} if need_dx else own

    def forward(self, ws: RandomPixelWs, x):
        if "factor" not in ws:
            return x
        ctx, out, factor = ws["ctx"], ws["out"], ws["factor"]
        x = x.reshape(out.shape)
        for e in range(len(x)):
            bits = np.random.Philox(
                key=[ctx["seed"] & (2**64 - 1), self.index],
                counter=[0, 0, ctx["step"], ctx["example0"] + e],
            )
            u = float(np.random.Generator(bits).random(dtype=np.float32))
            f = self.lo + (self.hi - self.lo) * u
            if self.kind == "brightness":
                factor[e] = f * (self.high - self.low)
                np.add(x[e], factor[e], out=out[e])
            else:
                factor[e] = f
                mean = x[e].mean(axis=(0, 1))
                np.subtract(x[e], mean, out=out[e])
                out[e] *= factor[e]
                out[e] += mean
        kept = ws["kept"]
        np.greater_equal(out, self.low, out=kept)
        kept &= out <= self.high
        np.clip(out, self.low, self.high, out=out)
        return out

    def backward_input(self, ws: RandomPixelWs, dout):
        if "factor" not in ws:
            return dout
        dx = ws["dx"]
        np.multiply(dout.reshape(dx.shape), ws["kept"], out=dx)
        if self.kind == "contrast":  # d/dx of (x - mean) a + mean: a g + (1 - a) mean(g)
            for e, a in enumerate(ws["factor"]):
                mean = dx[e].mean(axis=(0, 1))
                dx[e] *= a
                dx[e] += (1 - a) * mean
        return dx
