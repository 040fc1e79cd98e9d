"""Ops that rearrange or repeat values without arithmetic on them: Keras ``Permute`` (axes
reordered; its backward is the inverse permutation) and ``RepeatVector`` (a vector repeated
``n`` times; its backward sums the ``n`` copies' gradients). Each writes its own planned buffer,
so the next op reads a contiguous tensor."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op


class PermuteWs(TypedDict, total=False):
    """The buffers :class:`Permute` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray


class Permute(Op):
    """``Permute(dims)``: ``dims`` the 1-based order of the non-batch axes, as Keras'."""

    def __init__(self, in_shape, dims):
        self.in_shape, self.dims = tuple(in_shape), tuple(int(d) for d in dims)
        if sorted(self.dims) != list(range(1, len(self.in_shape) + 1)):
            raise ValueError(f"dims={list(dims)} is no permutation of axes 1..{len(in_shape)}")
        self.perm = (0, *self.dims)
        self.inverse = tuple(int(i) for i in np.argsort(self.perm))
        self.out_shape = tuple(self.in_shape[d - 1] for d in self.dims)

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def forward(self, ws: PermuteWs, x):
        x = x.reshape(x.shape[0], *self.in_shape)
        np.copyto(ws["out"], x.transpose(self.perm))
        return ws["out"]

    def backward_input(self, ws: PermuteWs, dout):
        dout = dout.reshape(ws["out"].shape)
        np.copyto(ws["dx"], dout.transpose(self.inverse))
        return ws["dx"]


class RepeatVectorWs(TypedDict, total=False):
    """The buffers :class:`RepeatVector` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    out: np.ndarray


class RepeatVector(Op):
    """``RepeatVector(n)``: ``(features,)`` → ``(n, features)``."""

    def __init__(self, in_shape, n: int):
        self.in_shape, self.n = tuple(in_shape), int(n)
        if len(self.in_shape) != 1 or self.n < 1:
            raise ValueError(f"needs a flat input and n >= 1, got {self.in_shape} and n={n}")
        self.out_shape = (self.n, self.in_shape[0])

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def forward(self, ws: RepeatVectorWs, x):
        np.copyto(ws["out"], x.reshape(x.shape[0], 1, -1))
        return ws["out"]

    def backward_input(self, ws: RepeatVectorWs, dout):
        np.sum(dout.reshape(ws["out"].shape), axis=1, out=ws["dx"])
        return ws["dx"]
