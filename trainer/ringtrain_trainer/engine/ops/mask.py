"""Keras masks as graph tensors: computed once per batch from the data, never differentiated.

Keras 3 attaches a boolean mask ``(batch, timesteps)`` to a tensor (``Embedding(mask_zero)``,
``Masking``) and hands it to the layers that read the tensor: an RNN skips masked timesteps, a
global average ignores them, merge layers AND them. Here a mask is an ordinary tensor of the
graph (float 0/1, so consumers multiply by it) written by a node of this file; the graph marks
it ``no_grad`` (``engine.graph``), so no backward runs through it. A consumer reads it as its
last input and returns ``None`` as that input's gradient.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

KINDS = ("zero", "value", "or")


class ComputeMaskWs(TypedDict, total=False):
    """The buffers :class:`ComputeMask` is compiled with (``buffers``, its state, ``bind``)."""

    ne: np.ndarray
    out: np.ndarray


class ComputeMask(Op):
    """``zero``: ``ids != 0`` (``Embedding(mask_zero=True)``, the ids' shape); ``value``:
    ``any(x != mask_value, axis=-1)`` (``Masking``); ``or``: the maximum of ``n`` masks of
    one shape (a merge layer's inputs' masks, Keras 3's ``logical_or``)."""

    kind = "mask"

    def __init__(self, in_shape, kind: str, value: float = 0.0, n: int = 1):
        if kind not in KINDS:
            raise ValueError(f"mask kind {kind!r} (supported: {KINDS})")
        self.in_shape, self.kind_, self.value, self.n_inputs = tuple(in_shape), kind, value, n
        self.in_shapes = [self.in_shape] * n
        self.out_shape = self.in_shape[:-1] if kind == "value" else self.in_shape

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if self.kind_ == "value":
            bufs["ne"] = ((b, *self.in_shape), "?")
        return bufs

    def forward(self, ws: ComputeMaskWs, *xs):
        out = ws["out"]
        if self.kind_ == "zero":
            np.not_equal(xs[0], 0, out=out, casting="unsafe")
        elif self.kind_ == "value":
            np.not_equal(xs[0], self.value, out=ws["ne"])
            np.any(ws["ne"], axis=-1, out=out, keepdims=False)
        else:
            np.copyto(out, xs[0])
            for m in xs[1:]:
                np.maximum(out, m, out=out)
        return out

    def backward_input(self, ws: ComputeMaskWs, dout):
        return None if self.n_inputs == 1 else (None,) * self.n_inputs


class AttentionMaskWs(TypedDict, total=False):
    """The buffers :class:`AttentionMask` is compiled with (``buffers``, its state, ``bind``)."""

    out: np.ndarray


class AttentionMask(Op):
    """``MultiHeadAttention``'s mask ``(T, S)`` from the Keras masks of its inputs: the
    query's ``(T,)`` along rows AND the value's (and a separate key's) ``(S,)`` along columns
    — Keras' ``_compute_attention_mask`` (the causal part is the attention op's own).
    ``sources``: which of "query", "value", "key" carry a mask, in the node's input order."""

    kind = "mask"

    def __init__(self, T: int, S: int, sources: tuple[str, ...]):
        if not sources or any(s not in ("query", "value", "key") for s in sources):
            raise ValueError(f"attention mask sources {sources!r}")
        self.sources, self.n_inputs = tuple(sources), len(sources)
        self.in_shapes = [(T,) if s == "query" else (S,) for s in sources]
        self.in_shape, self.out_shape = self.in_shapes[0], (T, S)

    def buffers(self, b, train, need_dx):
        return {"out": ((b, *self.out_shape), "f")}

    def forward(self, ws: AttentionMaskWs, *masks):
        out = ws["out"]
        out.fill(1)
        for src, m in zip(self.sources, masks, strict=True):
            np.multiply(out, m[:, :, None] if src == "query" else m[:, None, :], out=out)
        return out

    def backward_input(self, ws: AttentionMaskWs, dout):
        return None if self.n_inputs == 1 else (None,) * self.n_inputs


class ApplyMaskWs(TypedDict, total=False):
    """The buffers :class:`ApplyMask` is compiled with (``buffers``, its state, ``bind``)."""

    dx: np.ndarray
    m: np.ndarray
    out: np.ndarray


class ApplyMask(Op):
    """``Masking``'s output: ``x`` with its masked timesteps set to zero (Keras' ``where``);
    reads ``(x, mask)``, the mask from a :class:`ComputeMask` on the same ``x``."""

    kind = "mask"
    n_inputs = 2

    def __init__(self, in_shape):
        self.in_shape = self.out_shape = tuple(in_shape)
        self.in_shapes = [self.in_shape, self.in_shape[:-1]]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.in_shape), "f")}
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.in_shape) * (1 + train)

    def forward(self, ws: ApplyMaskWs, x, mask):
        ws["m"] = mask[..., None]
        return np.multiply(x, ws["m"], out=ws["out"])

    def backward_input(self, ws: ApplyMaskWs, dout):
        return np.multiply(dout, ws["m"], out=ws["dx"]), None
