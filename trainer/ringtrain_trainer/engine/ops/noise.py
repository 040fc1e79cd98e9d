"""Keras' training-time noise layers — ``GaussianNoise``, ``GaussianDropout``, ``AlphaDropout``
— as one affine op ``out = x * mult + add`` whose ``mult``/``add`` are drawn each step.

Why one op: all three are an elementwise affine map of the input with random coefficients, so
the backward is ``dout * mult`` for each. The draws are keyed like ``engine.ops.dropout.Dropout``'s
masks (Philox on (--seed, layer) at counter (step, global example)): a different draw every
step and every example, and the same draws for any worker count. In evaluation (predict, the
export) the op allocates nothing and is the identity, as Keras' ``training=False``.

Keras' formulas: GaussianNoise ``x + N(0, stddev)``; GaussianDropout ``x * N(1, sqrt(rate /
(1 - rate)))``; AlphaDropout with ``keep = U >= rate``, ``alpha' = -1.6733 * 1.0507``,
``a = ((1 - rate)(1 + rate alpha'^2))^-1/2``, ``b = -a alpha' rate``:
``a (x keep + alpha' (1 - keep)) + b``.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

MODES = ("gaussian_noise", "gaussian_dropout", "alpha_dropout")
_ALPHA_P = -1.6732632423543772848170429916717 * 1.0507009873554804934193349852946


class NoiseWs(TypedDict, total=False):
    """The buffers :class:`Noise` is compiled with (``buffers``, its state, ``bind``)."""

    add: np.ndarray
    ctx: dict[str, Any]
    dx: np.ndarray
    mult: np.ndarray
    out: np.ndarray


class Noise(Op):
    """``mode`` one of :data:`MODES`; ``amount`` the layer's ``stddev`` or ``rate``."""

    def __init__(self, shape, mode: str, amount: float, layer_index: int):
        if mode not in MODES:
            raise ValueError(f"noise mode {mode!r} is not one of {MODES}")
        self.in_shape = self.out_shape = tuple(shape)
        self.mode, self.amount, self.index = mode, float(amount), layer_index

    def _active(self) -> bool:
        return self.amount > 0

    def buffers(self, b, train, need_dx):
        if not train or not self._active():
            return {}
        shape = (b, *self.out_shape)
        return {"out": (shape, "f"), "mult": (shape, "f"), "add": (shape, "f"), "dx": (shape, "f")}

    def draw(self, ctx: dict, mult: np.ndarray, add: np.ndarray) -> None:
        """Fill ``mult`` and ``add`` (batch-first) for the step and examples of ``ctx``."""
        mrows, arows = mult.reshape(mult.shape[0], -1), add.reshape(add.shape[0], -1)
        r = self.amount
        for e in range(mrows.shape[0]):
            bits = np.random.Philox(
                key=[ctx["seed"] & (2**64 - 1), self.index],
                counter=[0, 0, ctx["step"], ctx["example0"] + e],
            )
            g, m, a = np.random.Generator(bits), mrows[e], arows[e]
            if self.mode == "gaussian_noise":
                m.fill(1.0)
                a[:] = g.standard_normal(a.size, np.float32) * np.float32(r)
            elif self.mode == "gaussian_dropout":
                a.fill(0.0)
                m[:] = g.standard_normal(m.size, np.float32)
                m *= m.dtype.type(math.sqrt(r / (1.0 - r)))
                m += 1.0
            else:
                scale = ((1 - r) * (1 + r * _ALPHA_P**2)) ** -0.5
                keep = g.random(m.size, np.float32) >= np.float32(r)
                np.multiply(keep, scale, out=m, casting="unsafe")
                np.multiply(~keep, scale * _ALPHA_P, out=a, casting="unsafe")
                a += -scale * _ALPHA_P * r

    def forward(self, ws: NoiseWs, x):
        if "mult" not in ws:
            ws["out"] = x
            return x
        self.draw(ws["ctx"], ws["mult"], ws["add"])
        np.multiply(x, ws["mult"], out=ws["out"])
        ws["out"] += ws["add"]
        return ws["out"]

    def backward_input(self, ws: NoiseWs, dout):
        if "mult" not in ws:
            return dout
        np.multiply(dout.reshape(ws["dx"].shape), ws["mult"], out=ws["dx"])
        return ws["dx"]
