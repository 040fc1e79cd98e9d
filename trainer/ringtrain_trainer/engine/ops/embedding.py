"""Keras ``Embedding``: integer token ids ``(b, *lead)`` → vectors ``(b, *lead, dim)``.

The data pipeline hands every input over as the program's float array, so the op casts the ids
into its own integer buffer (exact for ids below 2**24 in float32; ``data_npz`` checks the
ids are integers) and refuses an id outside ``[0, input_dim)`` — Keras on CPU refuses it too,
rather than reading a wrong row.

The gradient is a scatter-add of the output gradient into the rows the batch read. It is
streamed in row blocks like any weight (``engine.plan``), so each step sorts the (id, position)
pairs once (in place, one packed int64 key each, ``id << shift | position``: shifts and masks,
not int64 divisions) in ``backward_local`` and sums each run of
equal ids there with one ``np.add.reduceat`` (sorted segments); a block of rows ``[lo, hi)``
is then one ``searchsorted`` and one row assignment. Measured for 768 ids of width 8 (the zoo's
text models): ``np.add.at`` 724 µs, 8 ``np.bincount`` columns 225 µs, sorted segments 100 µs
(issue 24). No buffer scales with the vocabulary beyond the parameter itself.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.tensor import ParamSpec


class EmbeddingWs(TypedDict, total=False):
    """The buffers :class:`Embedding` is compiled with (``buffers``, its state, ``bind``)."""

    gathered: np.ndarray
    ids: np.ndarray
    iota: np.ndarray
    keys: np.ndarray
    new: np.ndarray
    out: np.ndarray
    pos: np.ndarray
    run_ids: np.ndarray
    run_sums: np.ndarray
    shift: np.ndarray
    sorted: np.ndarray
    sums: np.ndarray


class Embedding(Op):
    """Lookup of ``input_dim`` rows of width ``output_dim``; ``in_shape`` is the per-example
    shape of the id tensor (``(T,)`` for a sequence)."""

    kind = "embedding"

    def __init__(self, in_shape, input_dim: int, output_dim: int):
        self.in_shape = tuple(in_shape)
        self.out_shape = (*self.in_shape, output_dim)
        self.input_dim, self.output_dim = input_dim, output_dim
        self.per = math.prod(self.in_shape)

    def params(self, layer):
        shape = (self.input_dim, self.output_dim)
        # Keras' default uniform(-0.05, 0.05) is the Glorot draw of fan_in + fan_out = 2400
        return [ParamSpec(layer, "embeddings", shape, 1200, 1200, True)]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train:
            bufs["gathered"] = ((b * self.per, self.output_dim), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * self.per * self.output_dim * (1 + 2 * train)

    def bind(self, ws: EmbeddingWs, b):
        n = b * self.per
        # integer buffers: the Program plans float and bool ones; these are as small as the ids
        ws["ids"] = np.zeros(n, np.int64)
        ws["shift"] = max(n - 1, 1).bit_length()  # a key is id << shift | position
        if "gathered" in ws:
            ws["keys"], ws["sorted"], ws["pos"] = (np.zeros(n, np.int64) for _ in range(3))
            ws["iota"] = np.arange(n, dtype=np.int64)
            ws["new"] = np.zeros(n, np.bool_)
            ws["sums"] = np.zeros_like(ws["gathered"])

    def forward(self, ws: EmbeddingWs, x, embeddings):
        ids = ws["ids"]
        np.copyto(ids, x.reshape(-1), casting="unsafe")
        lo, hi = np.minimum.reduce(ids), np.maximum.reduce(ids)
        if lo < 0 or hi >= self.input_dim:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"Embedding: token id {bad} is outside [0, {self.input_dim}) (input_dim)"
            )
        out = ws["out"]
        embeddings.take(ids, axis=0, out=out.reshape(-1, self.output_dim))
        return out

    def backward_local(self, ws: EmbeddingWs, dout):
        keys, shift = ws["keys"], ws["shift"]
        np.left_shift(ws["ids"], shift, out=keys)
        np.bitwise_or(keys, ws["iota"], out=keys)
        keys.sort()
        np.right_shift(keys, shift, out=ws["sorted"])
        np.bitwise_and(keys, (1 << shift) - 1, out=ws["pos"])
        dout.reshape(-1, self.output_dim).take(ws["pos"], axis=0, out=ws["gathered"])
        ids, new = ws["sorted"], ws["new"]
        new[0] = True
        np.not_equal(ids[1:], ids[:-1], out=new[1:])
        starts = new.nonzero()[0]
        ws["run_ids"] = ids[starts]
        ws["run_sums"] = sums = ws["sums"][: starts.size]
        np.add.reduceat(ws["gathered"], starts, axis=0, out=sums)

    def backward_input(self, ws: EmbeddingWs, dout, embeddings):
        return None  # the ids are data: nothing upstream takes a gradient

    def backward_weights(self, ws: EmbeddingWs, dout, name, grad, rows):
        lo, hi = rows
        grad[lo:hi] = 0
        s, e = ws["run_ids"].searchsorted((lo, hi))
        grad[ws["run_ids"][s:e]] = ws["run_sums"][s:e]
