"""Keras' image augmentation layers that ringtrain runs: ``RandomFlip``. Training only (the
identity in predict and in the export, as Keras' ``training=False``). A flip is a permutation,
so its backward is the same flip of the upstream gradient and it may sit anywhere.

Keras 3.15's draw: one uniform per image, ``u <= 0.5`` flips it — along the width
("horizontal"), the height ("vertical"), or both at once ("horizontal_and_vertical": the same
draw for both axes, as ``RandomFlip._flip_inputs`` applies it). The draw is keyed like
``Dropout``'s masks (Philox on (--seed, layer) at counter (step, global example)): a new draw
each step, the same for any worker count.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.layers.base import Layer

FLIP_MODES = ("horizontal", "vertical", "horizontal_and_vertical")


class RandomFlip(Layer):
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

    def forward(self, ws, x):
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

    def backward_input(self, ws, dout):
        if "flips" not in ws:
            return dout
        dx, dout = ws["dx"], dout.reshape(ws["dx"].shape)
        for e, flipped in enumerate(ws["flips"]):
            np.copyto(dx[e], np.flip(dout[e], self.axes) if flipped else dout[e])
        return dx
