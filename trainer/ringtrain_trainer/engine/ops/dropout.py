"""Dropout: inverted dropout with deterministic masks, and dropout whose mask is shared along axes.

Dropout is deterministic: the mask of example ``e`` of the *global* batch (all workers, in
rank order) at step ``s`` comes from a Philox stream keyed by (``--seed``, layer) at counter
(``s``, ``e``). It depends on neither the number of workers nor of replicas or host threads,
so N workers with batch B draw exactly the masks of one worker with batch N·B. The Program's
``ctx`` dict (``seed``, ``step``, ``example0``: the global index of its first example) is set by
the IPU before each step.

:class:`SharedDropout`: a mask shared along some axes — Keras ``Dropout(noise_shape=...)`` and
``SpatialDropout1D/2D`` (one keep/drop per example and channel, the same over every position).
EfficientNet's stochastic depth is ``Dropout(noise_shape=(None, 1, 1, 1))``: one draw per
example drops a whole residual branch.

The mask is drawn exactly as :class:`Dropout` draws it (Philox keyed on --seed, the
layer, the step and the global example), only smaller — one value per example over the noise
shape — and broadcast over the rest, so any worker count draws the same masks.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op


class DropoutWs(TypedDict, total=False):
    """The buffers :class:`Dropout` is compiled with (``buffers``, its state, ``bind``)."""

    ctx: dict[str, Any]
    dx: np.ndarray
    keep: np.ndarray
    out: np.ndarray


class Dropout(Op):
    """Inverted dropout (``x * keep / (1 - rate)``) in training, identity in evaluation."""

    def __init__(self, shape, rate, layer_index):
        self.in_shape = self.out_shape = tuple(shape)
        self.rate, self.index = rate, layer_index
        self.per = math.prod(shape)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        return {"out": (shape, "f"), "keep": (shape, "f"), "dx": (shape, "f")}

    def forward(self, ws: DropoutWs, x):
        if "keep" not in ws or self.rate == 0:
            ws["out"] = x
            return x
        ctx, keep = ws["ctx"], ws["keep"]
        masks(ctx["seed"], self.index, ctx["step"], ctx["example0"], self.rate, keep)
        np.multiply(x, keep, out=ws["out"])
        return ws["out"]

    def backward_input(self, ws: DropoutWs, dout):
        if "keep" not in ws or self.rate == 0:
            return dout
        np.multiply(dout.reshape(ws["keep"].shape), ws["keep"], out=ws["dx"])
        return ws["dx"]


def masks(seed: int, layer: int, step: int, example0: int, rate: float, out: np.ndarray) -> None:
    """Per example ``e``: Philox keyed (seed, layer) at counter (0, 0, step, example0 + e),
    uniform float32 ≥ rate → ``1 / (1 - rate)``, else 0.

    ``Generator.random(n, float32)`` of a fresh Philox at that counter, for every example at
    once: one bit generator whose counter is set per example (a new Philox and Generator per
    example cost ≈ 70 µs each, 2.3 ms for 32 RNN examples), its raw 64-bit words split into
    32-bit halves low first and ``(w >> 8) · 2⁻²⁴`` as numpy's float32 draw does — the same
    values to the last bit (tests/trainer/test_dropout_masks.py)."""
    rows = out.reshape(out.shape[0], -1)
    b, n = rows.shape
    words = -(-n // 8) * 4  # a Philox block: four 64-bit words, eight float32 draws
    raw = np.empty((b, words), np.uint64)
    bits = np.random.Philox(key=[seed & (2**64 - 1), layer])
    state = bits.state
    # a fresh generator's buffer
    state["buffer_pos"], state["has_uint32"], state["uinteger"] = 4, 0, 0
    for e in range(b):
        state["state"]["counter"] = np.array([0, 0, step, example0 + e], np.uint64)
        bits.state = state
        raw[e] = bits.random_raw(words)
    halves = np.empty((b, 2 * words), np.uint32)
    np.copyto(halves[:, 0::2], raw, casting="unsafe")  # the low 32 bits first
    np.right_shift(raw, np.uint64(32), out=raw)
    np.copyto(halves[:, 1::2], raw, casting="unsafe")
    np.right_shift(halves, np.uint32(8), out=halves)
    uf = halves[:, :n].astype(np.float32)
    np.multiply(uf, np.float32(1.0 / 16777216.0), out=uf)
    scale = out.dtype.type(1.0 / (1.0 - rate))
    np.multiply(uf >= rate, scale, out=rows, casting="unsafe")


class SharedDropout(Dropout):
    """Inverted dropout with a mask of per-example shape ``noise`` (1 on the shared axes)."""

    def __init__(self, shape, rate, layer_index, noise):
        super().__init__(shape, rate, layer_index)
        self.noise = tuple(noise)
        if len(self.noise) != len(self.in_shape) or any(
            n not in (1, d) for n, d in zip(self.noise, self.in_shape, strict=True)
        ):
            raise ValueError(f"noise_shape {self.noise} does not broadcast to {self.in_shape}")

    def buffers(self, b, train, need_dx):  # ``forward`` (the base's) broadcasts ``keep``
        if not train:
            return {}
        shape = (b, *self.out_shape)
        return {"out": (shape, "f"), "keep": ((b, *self.noise), "f"), "dx": (shape, "f")}

    def backward_input(self, ws: DropoutWs, dout):
        if "keep" not in ws or self.rate == 0:
            return dout
        np.multiply(dout.reshape(ws["dx"].shape), ws["keep"], out=ws["dx"])
        return ws["dx"]
