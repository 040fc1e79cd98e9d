"""Keras ``CategoryEncoding``: integer ids ``(b, k)`` → a ``num_tokens`` wide encoding —
``one_hot`` (per id; ``k = 1`` gives ``(num_tokens,)``, else ``(k, num_tokens)``),
``multi_hot`` (1 where an id occurs) or ``count`` (how often it occurs).

It reads a model input only (the registry entry refuses it elsewhere): ids have no gradient,
so the op has no backward. As for ``Embedding``, the program hands ids over as floats; they
are cast into the op's own integer buffer, and an id outside ``[0, num_tokens)`` is refused
rather than encoded as nothing.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op

MODES = ("one_hot", "multi_hot", "count")


class CategoryEncodeWs(TypedDict, total=False):
    """The buffers :class:`CategoryEncode` is compiled with (``buffers``, its state, ``bind``)."""

    base: np.ndarray
    ids: np.ndarray
    out: np.ndarray


class CategoryEncode(Op):
    """Encode ids of per-example shape ``(k,)`` into ``num_tokens`` columns by ``mode``."""

    kind = "category_encoding"

    def __init__(self, in_shape, num_tokens: int, mode: str):
        self.in_shape, self.n, self.mode = tuple(in_shape), num_tokens, mode
        self.k = math.prod(self.in_shape)
        if mode == "one_hot" and self.k > 1:
            self.out_shape: tuple[int, ...] = (*self.in_shape, num_tokens)
        else:
            self.out_shape = (num_tokens,)

    def buffers(self, b, train, need_dx):
        if need_dx:
            raise ValueError("CategoryEncoding has no gradient: it must read a model input")
        return {"out": ((b, *self.out_shape), "f")}

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape)

    def bind(self, ws: CategoryEncodeWs, b):
        ws["ids"] = np.zeros(b * self.k, np.int64)
        # the flat output position of example i's k-th id: one_hot a row per id, else per example
        per = self.n if self.mode == "one_hot" else 0
        ws["base"] = np.arange(b * self.k, dtype=np.int64) * per
        if self.mode != "one_hot":
            ws["base"] = np.repeat(np.arange(b, dtype=np.int64) * self.n, self.k)

    def forward(self, ws: CategoryEncodeWs, x):
        ids, out = ws["ids"], ws["out"]
        np.copyto(ids, x.reshape(-1), casting="unsafe")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise ValueError(
                f"CategoryEncoding: an id outside [0, {self.n}) (num_tokens={self.n}): "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        out.fill(0)
        np.add(ids, ws["base"], out=ids)
        flat = out.reshape(-1)
        if self.mode == "count":
            np.add.at(flat, ids, 1)
        else:
            flat[ids] = 1
        return out

    def backward_input(self, ws: CategoryEncodeWs, dout):
        raise ValueError("CategoryEncoding has no gradient: it must read a model input")
