"""Dropout whose mask is shared along some axes — Keras ``Dropout(noise_shape=...)`` and
``SpatialDropout1D/2D`` (one keep/drop per example and channel, the same over every position).
EfficientNet's stochastic depth is ``Dropout(noise_shape=(None, 1, 1, 1))``: one draw per
example drops a whole residual branch.

The mask is drawn exactly as ``layers.base.Dropout`` draws it (Philox keyed on --seed, the
layer, the step and the global example), only smaller — one value per example over the noise
shape — and broadcast over the rest, so any worker count draws the same masks.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.layers.base import Dropout


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

    def backward_input(self, ws, dout):
        if "keep" not in ws or self.rate == 0:
            return dout
        np.multiply(dout.reshape(ws["dx"].shape), ws["keep"], out=ws["dx"])
        return ws["dx"]
