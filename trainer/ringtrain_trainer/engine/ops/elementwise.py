"""Element-wise ops: Activation / ReLU / Softmax layers and Rescaling, and Keras ``Add``.

Pipeline position: built by ``keras.layers_core`` and ``keras.layers_merge`` entries; an
activation runs in place through ``activations``' table.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.activations import act_backward, act_forward


class ElementwiseWs(TypedDict, total=False):
    """The buffers :class:`Elementwise` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray


class Elementwise(Op):
    """Activation / ReLU / Softmax layers and Rescaling (``x * scale + offset``)."""

    def __init__(self, shape, act="linear", scale=1.0, offset=0.0):
        self.in_shape = self.out_shape = tuple(shape)
        self.act, self.scale, self.offset = act, scale, offset

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (1 + train)

    def forward(self, ws: ElementwiseWs, x):
        out = ws["out"]
        np.multiply(x, out.dtype.type(self.scale), out=out)
        if self.offset:
            np.add(out, out.dtype.type(self.offset), out=out)
        act_forward(self.act, out)
        return out

    def backward_input(self, ws: ElementwiseWs, dout):
        dx = ws["dx"]
        act_backward(self.act, ws["out"], dout.reshape(dx.shape), dx)
        if self.scale != 1.0:
            np.multiply(dx, dx.dtype.type(self.scale), out=dx)
        return dx


class AddWs(TypedDict, total=False):
    """The buffers :class:`Add` is compiled with (``buffers``, its state, ``bind``)."""

    out: np.ndarray


class Add(Op):
    """Keras ``Add``: the element-wise sum of its inputs, all of one shape. Its input gradients
    are the output's gradient itself, once per input; the Program sums them into whichever
    tensor is read twice (a residual connection)."""

    def __init__(self, shape, n_inputs: int = 2):
        self.in_shape = self.out_shape = tuple(shape)
        self.n_inputs = n_inputs

    def buffers(self, b, train, need_dx):
        return {"out": ((b, *self.out_shape), "f")}

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (self.n_inputs - 1)

    def forward(self, ws: AddWs, *xs):
        out = ws["out"]
        np.add(xs[0], xs[1], out=out)
        for x in xs[2:]:
            np.add(out, x, out=out)
        return out

    def backward_input(self, ws: AddWs, dout):
        return (dout,) * self.n_inputs
