"""Keras ``MultiHeadAttention`` on sequences: ``query (b, T, dq)``, ``value (b, S, dv)``,
``key (b, S, dk)`` (key defaults to value) → ``(b, T, dq)``.

Inputs, in the node's order: ``query``, then ``value`` and ``key`` when they are separate
tensors (``n_inputs`` 1 = self-attention on one tensor, 2 = key is value, 3 = all three), then
an optional boolean ``attention_mask (b, T, S)`` (data: no gradient). ``causal`` is Keras'
``use_causal_mask=True``; with a mask too, both apply (logical and), as in Keras.

The arithmetic is Keras' non-fused path: project, scale the query by ``1/sqrt(key_dim)`` after
its bias, scores ``q·k``, masked positions set to ``-1e9`` before the softmax over keys (so a
fully masked row attends uniformly, as Keras' does), context ``p·v``, project out. Each
projection is one matmul on the ``(b·T, d)`` view; the per-head products read and write
``(b, heads, T, ·)`` views of those buffers laid out at bind time (each head's block is a
strided matrix BLAS takes as is: no per-step copies), and the scores are stored keys-major
so the softmax's per-row max, sum and broadcasts run along the long axis (``softmax_keys``).
Backward keeps all of it (probabilities included) from forward, the price of no recomputation.

``dropout`` is Keras' attention dropout: in training the probabilities are multiplied by an
inverted-dropout mask before ``p·v`` (one mask per example over heads × queries × keys, drawn
as every ringtrain Dropout draws it: keyed on the run's seed, the layer, the step and the
global example, so any worker count draws the same masks); inference runs without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.dense import product_rows
from ringtrain_trainer.engine.ops.dropout import masks
from ringtrain_trainer.engine.tensor import ParamSpec

#: Keras' ``_large_negative_number`` for float32 and float64 scores
MASKED = -1e9
_PROJ = ("query", "key", "value")


def keys_major(buf: np.ndarray) -> np.ndarray:
    """The ``(..., queries, keys)`` view of a keys-major scores buffer ``(keys, ...,
    queries)``: what the batched products read and write (a column-major matrix per head,
    which BLAS takes as is)."""
    return np.moveaxis(buf, 0, -1)


def softmax_keys(a2: np.ndarray, rowsum: np.ndarray) -> None:
    """Scores → probabilities over keys, in place, max-shifted as Keras' softmax. ``a2`` is
    the keys-major ``(keys, rows)`` buffer and ``rowsum`` a ``(rows,)`` one: every per-row
    max, sum and broadcast runs along the long contiguous axis (an attention row is a handful
    of keys; numpy's reductions over a last axis that short cost more than the exponentials,
    issue 24). Both attention ops."""
    np.maximum.reduce(a2, axis=0, out=rowsum)
    np.subtract(a2, rowsum, out=a2)
    np.exp(a2, out=a2)
    np.add.reduce(a2, axis=0, out=rowsum)
    np.divide(a2, rowsum, out=a2)


def softmax_keys_backward(p2: np.ndarray, d2: np.ndarray, rowsum: np.ndarray) -> None:
    """The probabilities' gradient ``d2`` → the scores', in place, in the layout of
    :func:`softmax_keys`: ``p * (d_p - sum(p * d_p))``; ``p2`` is overwritten."""
    np.multiply(d2, p2, out=d2)
    np.add.reduce(d2, axis=0, out=rowsum)
    np.multiply(p2, rowsum, out=p2)
    np.subtract(d2, p2, out=d2)


class MultiHeadAttention(Op):
    """Multi-head scaled dot-product attention; ``in_shapes``: the per-example shapes of the
    query, value and key inputs this node reads (value and key default to the query's)."""

    kind = "attention"

    def __init__(
        self,
        in_shapes,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        use_bias: bool = True,
        causal: bool = False,
        mask_input: bool = False,
        dropout: float = 0.0,
        index: int = 0,
    ):
        shapes = [tuple(s) for s in in_shapes]
        if not 1 <= len(shapes) <= 3 or any(len(s) != 2 for s in shapes):
            raise ValueError(f"MultiHeadAttention: 1-3 inputs of shape (T, d), got {shapes}")
        self.n_inputs = len(shapes) + mask_input
        q, v = shapes[0], shapes[min(1, len(shapes) - 1)]
        k = shapes[2] if len(shapes) == 3 else v
        if k[0] != v[0]:
            raise ValueError(f"MultiHeadAttention: key length {k[0]} != value length {v[0]}")
        self.in_shape = q
        self.in_shapes = shapes + ([(q[0], v[0])] if mask_input else [])
        self.T, self.S = q[0], v[0]
        self.dims = {"query": q[1], "key": k[1], "value": v[1]}
        self.h, self.kd = num_heads, key_dim
        self.vd = key_dim if value_dim is None else value_dim
        self.out_shape = q
        self.use_bias, self.causal, self.mask_input = use_bias, causal, mask_input
        self.n_data = len(shapes)
        self.rate, self.index = float(dropout), index

    def _width(self, name):
        return self.vd if name == "value" else self.kd

    def params(self, layer):
        ps, h = [], self.h
        for name in _PROJ:
            d, w = self.dims[name], self._width(name)
            ps.append(ParamSpec(layer, f"{name}_kernel", (d, h, w), d, h * w, True))
            if self.use_bias:
                ps.append(ParamSpec(layer, f"{name}_bias", (h, w), 0, 0, False))
        dout, fan_in = self.out_shape[1], h * self.vd
        shape = (h, self.vd, dout)
        ps.append(ParamSpec(layer, "attention_output_kernel", shape, fan_in, dout, True))
        if self.use_bias:
            ps.append(ParamSpec(layer, "attention_output_bias", (dout,), 0, 0, False))
        return ps

    def buffers(self, b, train, need_dx):
        T, S, h, vd = self.T, self.S, self.h, self.vd
        length = {"query": T, "key": S, "value": S}
        # the scores keys-major (``softmax_keys``); "att" is their (b, h, T, S) view
        bufs = {"out": ((b, *self.out_shape), "f"), "scores": ((S, b, h, T), "f")}
        bufs["rowsum"] = ((b * h * T,), "f")
        for name in _PROJ:
            w, n = self._width(name), length[name]
            bufs[f"p_{name}"] = ((b * n, h * w), "f")  # projection, (b, n, h, w) row-major
        bufs["context"] = ((b * T, h * vd), "f")
        if self.causal:
            bufs["causal"] = ((1, T, S), "b")
        if self.causal or self.mask_input:
            bufs["masked"] = (((b if self.mask_input else 1), T, S), "b")
        if train and self.rate:
            bufs.update({"keep": ((b, h, T, S), "f"), "dropped": ((b, h, T, S), "f")})
        if train:
            bufs.update({"d_ctx": ((b * T, h * vd), "f"), "d_scores": ((S, b, h, T), "f")})
            bufs["ones"] = ((b * max(T, S),), "f")
            for name in _PROJ:
                w, n = self._width(name), length[name]
                bufs[f"dp_{name}"] = ((b * n, h * w), "f")
            if need_dx:
                for k, s in enumerate(self.in_shapes[: self.n_data]):
                    bufs[f"dx{k}"] = ((b, *s), "f")
                if self.n_data < 3:
                    bufs["dx_acc"] = ((b * S, self.dims["value"]), "f")
        return bufs

    def flops(self, b, train, need_dx):
        T, S, h, kd, vd = self.T, self.S, self.h, self.kd, self.vd
        d = self.dims
        proj = T * d["query"] * h * kd + S * (d["key"] * h * kd + d["value"] * h * vd)
        proj += T * h * vd * self.out_shape[1]
        fwd = 2 * b * (proj + h * T * S * (kd + vd))
        return fwd * (1 + (2 if train else 0))

    def bind(self, ws: dict[str, Any], b):
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["att"] = keys_major(ws["scores"])
        if "d_scores" in ws:
            ws["d_att"] = keys_major(ws["d_scores"])
        # per-head views (b, heads, n, w) of the (b·n, heads·w) projections and their
        # gradients, laid out once: the batched products read and write them in place
        for key in ("p", "dp"):
            for name in _PROJ:
                if f"{key}_{name}" in ws:
                    ws[f"{key}h_{name}"] = self._heads(ws[f"{key}_{name}"], b, name)
        ws["ctxh"] = self._heads(ws["context"], b, "value")
        if "d_ctx" in ws:
            ws["d_ctxh"] = self._heads(ws["d_ctx"], b, "value")
        if self.causal:
            t, s = np.indices((self.T, self.S))
            np.greater(s, t, out=ws["causal"][0])
            np.copyto(ws["masked"], ws["causal"])

    def _heads(self, buf, b, name):
        """The (b, heads, n, w) view of a (b·n, heads·w) projection-shaped buffer."""
        return buf.reshape(b, -1, self.h, self._width(name)).transpose(0, 2, 1, 3)

    def _inputs(self, xs):
        """(query, key, value) tensors from the node's inputs, and the mask input or None."""
        data, mask = xs[: self.n_data], (xs[self.n_data] if self.mask_input else None)
        q = data[0]
        v = data[1] if len(data) > 1 else q
        k = data[2] if len(data) > 2 else v
        return {"query": q, "key": k, "value": v}, mask

    def forward(self, ws: dict[str, Any], *xs, **p):
        inputs, mask = self._inputs(xs)
        ws["inputs"] = {}
        for name, x in inputs.items():
            x2 = ws["inputs"][name] = x.reshape(-1, self.dims[name])
            pr = ws[f"p_{name}"]
            np.matmul(x2, p[f"{name}_kernel"].reshape(self.dims[name], -1), out=pr)
            if self.use_bias:
                np.add(pr, p[f"{name}_bias"].reshape(-1), out=pr)
            if name == "query":
                np.multiply(pr, pr.dtype.type(1.0 / np.sqrt(self.kd)), out=pr)
        att = ws["att"]
        np.matmul(ws["ph_query"], ws["ph_key"].transpose(0, 1, 3, 2), out=att)
        if mask is not None:
            np.less(mask, 0.5, out=ws["masked"])
            if self.causal:
                np.logical_or(ws["masked"], ws["causal"], out=ws["masked"])
        if "masked" in ws:
            np.copyto(att, att.dtype.type(MASKED), where=ws["masked"][:, None])
        softmax_keys(ws["scores"].reshape(self.S, -1), ws["rowsum"])
        if "keep" in ws:
            c, keep = ws["ctx"], ws["keep"]
            masks(c["seed"], self.index, c["step"], c["example0"], self.rate, keep)
            np.multiply(att, keep, out=ws["dropped"])
        np.matmul(ws.get("dropped", att), ws["ph_value"], out=ws["ctxh"])
        out = ws["out"]
        o2 = out.reshape(-1, self.out_shape[1])
        ws["wo"] = wo = p["attention_output_kernel"].reshape(self.h * self.vd, -1)
        np.matmul(ws["context"], wo, out=o2)
        if self.use_bias:
            np.add(o2, p["attention_output_bias"], out=o2)
        return out

    def backward_local(self, ws: dict[str, Any], dout):
        """From the output's gradient down to the three projections' (``dp_*``), which both
        halves read. The output kernel is the one forward read (``ws["wo"]``): nothing updates
        a node's weights before its own backward has streamed them."""
        att, d_att, dch = ws["att"], ws["d_att"], ws["d_ctxh"]
        np.matmul(dout.reshape(-1, self.out_shape[1]), ws["wo"].T, out=ws["d_ctx"])
        np.matmul(ws.get("dropped", att).transpose(0, 1, 3, 2), dch, out=ws["dph_value"])
        np.matmul(dch, ws["ph_value"].transpose(0, 1, 3, 2), out=d_att)
        if "keep" in ws:  # through the dropout mask to the probabilities
            np.multiply(d_att, ws["keep"], out=d_att)
        p2, d2 = ws["scores"].reshape(self.S, -1), ws["d_scores"].reshape(self.S, -1)
        softmax_keys_backward(p2, d2, ws["rowsum"])  # the probabilities are not needed after
        np.matmul(d_att, ws["ph_key"], out=ws["dph_query"])
        np.matmul(d_att.transpose(0, 1, 3, 2), ws["ph_query"], out=ws["dph_key"])
        dpq = ws["dp_query"]
        np.multiply(dpq, dpq.dtype.type(1.0 / np.sqrt(self.kd)), out=dpq)

    def backward_input(self, ws: dict[str, Any], dout, **p):
        """One gradient per data input; a tensor that feeds several projections (self-
        attention, key = value) gets their sum, accumulated through ``dx_acc``."""
        dxs = [ws[f"dx{k}"] for k in range(self.n_data)]
        target = {"query": 0, "value": min(1, self.n_data - 1), "key": min(2, self.n_data - 1)}
        written: set[int] = set()
        for name in _PROJ:
            k, dp = target[name], ws[f"dp_{name}"]
            kern = p[f"{name}_kernel"].reshape(self.dims[name], -1)
            dx2 = dxs[k].reshape(-1, self.dims[name])
            if k in written:
                acc = ws["dx_acc"]
                np.matmul(dp, kern.T, out=acc)
                np.add(dx2, acc, out=dx2)
            else:
                np.matmul(dp, kern.T, out=dx2)
                written.add(k)
        if self.mask_input:
            return (*dxs, None)
        return dxs[0] if self.n_inputs == 1 else tuple(dxs)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        proj, part = name.rsplit("_", 1)
        if proj == "attention_output":
            src, d = ws["context"], dout.reshape(-1, self.out_shape[1])
        else:
            src, d = ws["inputs"][proj], ws[f"dp_{proj}"]
        if part == "kernel":
            product_rows(src, d, grad, rows)
        else:
            ones = ws["ones"][: d.shape[0]].reshape(-1, 1)
            product_rows(ones, d, grad, rows)
