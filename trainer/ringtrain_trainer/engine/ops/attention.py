"""Keras ``MultiHeadAttention`` on sequences: ``query (b, T, dq)``, ``value (b, S, dv)``,
``key (b, S, dk)`` (key defaults to value) → ``(b, T, dq)``.

Inputs, in the node's order: ``query``, then ``value`` and ``key`` when they are separate
tensors (``n_inputs`` 1 = self-attention on one tensor, 2 = key is value, 3 = all three), then
an optional boolean ``attention_mask (b, T, S)`` (data: no gradient). ``causal`` is Keras'
``use_causal_mask=True``; with a mask too, both apply (logical and), as in Keras.

The arithmetic is Keras' non-fused path: project, scale the query by ``1/sqrt(key_dim)`` after
its bias, scores ``q·k``, masked positions set to ``-1e9`` before the softmax over keys (so a
fully masked row attends uniformly, as Keras' does), context ``p·v``, project out. Each
projection is one matmul on the ``(b·T, d)`` view; the per-head products run on
``(b, heads, T, ·)`` copies so every batched matmul is a BLAS call, not numpy's strided loop.
Backward keeps all of it (probabilities included) from forward, the price of no recomputation.

``dropout`` is Keras' attention dropout: in training the probabilities are multiplied by an
inverted-dropout mask before ``p·v`` (one mask per example over heads × queries × keys, drawn
as every ringtrain Dropout draws it: keyed on the run's seed, the layer, the step and the
global example, so any worker count draws the same masks); inference runs without it.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.dense import product_rows
from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer, masks

#: Keras' ``_large_negative_number`` for float32 and float64 scores
MASKED = -1e9
_PROJ = ("query", "key", "value")


def softmax_rows(att: np.ndarray, rowsum: np.ndarray) -> None:
    """Scores → probabilities over the last axis, in place (``rowsum``: the scores' shape
    with a last axis of 1, planned): max-shifted as Keras' softmax. Both attention ops."""
    np.max(att, axis=-1, keepdims=True, out=rowsum)
    np.subtract(att, rowsum, out=att)
    np.exp(att, out=att)
    np.sum(att, axis=-1, keepdims=True, out=rowsum)
    np.divide(att, rowsum, out=att)


class MultiHeadAttention(Layer):
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
        T, S, h, kd, vd = self.T, self.S, self.h, self.kd, self.vd
        length = {"query": T, "key": S, "value": S}
        bufs = {"out": ((b, *self.out_shape), "f"), "att": ((b, h, T, S), "f")}
        bufs["rowsum"] = ((b, h, T, 1), "f")
        for name in _PROJ:
            w, n = self._width(name), length[name]
            bufs[f"p_{name}"] = ((b * n, h * w), "f")  # projection, (b, n, h, w) row-major
            bufs[f"h_{name}"] = ((b, h, n, w), "f")  # per head
        bufs.update({"ctx_h": ((b, h, T, vd), "f"), "context": ((b * T, h * vd), "f")})
        if self.causal:
            bufs["causal"] = ((1, T, S), "b")
        if self.causal or self.mask_input:
            bufs["masked"] = (((b if self.mask_input else 1), T, S), "b")
        if train and self.rate:
            bufs.update({"keep": ((b, h, T, S), "f"), "dropped": ((b, h, T, S), "f")})
        if train:
            bufs.update({"d_ctx": ((b * T, h * vd), "f"), "d_att": ((b, h, T, S), "f")})
            bufs["ones"] = ((b * max(T, S),), "f")
            for name in _PROJ:
                w, n = self._width(name), length[name]
                bufs[f"dh_{name}"] = ((b, h, n, w), "f")
                bufs[f"dp_{name}"] = ((b * n, h * w), "f")
            bufs["row"] = ((h * max(kd, vd, self.out_shape[1]),), "f")
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

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        if self.causal:
            t, s = np.indices((self.T, self.S))
            np.greater(s, t, out=ws["causal"][0])
            np.copyto(ws["masked"], ws["causal"])

    def _inputs(self, xs):
        """(query, key, value) tensors from the node's inputs, and the mask input or None."""
        data, mask = xs[: self.n_data], (xs[self.n_data] if self.mask_input else None)
        q = data[0]
        v = data[1] if len(data) > 1 else q
        k = data[2] if len(data) > 2 else v
        return {"query": q, "key": k, "value": v}, mask

    def forward(self, ws, *xs, **p):
        b = ws["out"].shape[0]
        inputs, mask = self._inputs(xs)
        ws["inputs"] = {}
        for name, x in inputs.items():
            x2 = ws["inputs"][name] = x.reshape(-1, self.dims[name])
            pr, w = ws[f"p_{name}"], self._width(name)
            np.matmul(x2, p[f"{name}_kernel"].reshape(self.dims[name], -1), out=pr)
            if self.use_bias:
                np.add(pr, p[f"{name}_bias"].reshape(-1), out=pr)
            if name == "query":
                np.multiply(pr, pr.dtype.type(1.0 / np.sqrt(self.kd)), out=pr)
            hb = ws[f"h_{name}"]
            np.copyto(hb, pr.reshape(b, -1, self.h, w).transpose(0, 2, 1, 3))
        att = ws["att"]
        np.matmul(ws["h_query"], ws["h_key"].transpose(0, 1, 3, 2), out=att)
        if mask is not None:
            np.less(mask, 0.5, out=ws["masked"])
            if self.causal:
                np.logical_or(ws["masked"], ws["causal"], out=ws["masked"])
        if "masked" in ws:
            np.copyto(att, att.dtype.type(MASKED), where=ws["masked"][:, None])
        softmax_rows(att, ws["rowsum"])
        if "keep" in ws:
            c, keep = ws["ctx"], ws["keep"]
            masks(c["seed"], self.index, c["step"], c["example0"], self.rate, keep)
            np.multiply(att, keep, out=ws["dropped"])
        np.matmul(ws.get("dropped", att), ws["h_value"], out=ws["ctx_h"])
        ctx = ws["context"]
        np.copyto(ctx.reshape(b, self.T, self.h, self.vd), ws["ctx_h"].transpose(0, 2, 1, 3))
        out = ws["out"]
        o2 = out.reshape(-1, self.out_shape[1])
        ws["wo"] = p["attention_output_kernel"].reshape(self.h * self.vd, -1)
        np.matmul(ctx, p["attention_output_kernel"].reshape(self.h * self.vd, -1), out=o2)
        if self.use_bias:
            np.add(o2, p["attention_output_bias"], out=o2)
        return out

    def backward_local(self, ws, dout):
        """From the output's gradient down to the three projections' (``dp_*``), which both
        halves read. The output kernel is the one forward read (``ws["wo"]``): nothing updates
        a node's weights before its own backward has streamed them."""
        b, h, T, vd = dout.shape[0], self.h, self.T, self.vd
        d_ctx, att, d_att = ws["d_ctx"], ws["att"], ws["d_att"]
        np.matmul(dout.reshape(-1, self.out_shape[1]), ws["wo"].T, out=d_ctx)
        dch = ws["ctx_h"]  # free after forward: reused for the context's per-head gradient
        np.copyto(dch, d_ctx.reshape(b, T, h, vd).transpose(0, 2, 1, 3))
        np.matmul(ws.get("dropped", att).transpose(0, 1, 3, 2), dch, out=ws["dh_value"])
        np.matmul(dch, ws["h_value"].transpose(0, 1, 3, 2), out=d_att)
        if "keep" in ws:  # through the dropout mask to the probabilities
            np.multiply(d_att, ws["keep"], out=d_att)
        rowsum = ws["rowsum"]
        np.multiply(d_att, att, out=d_att)
        np.sum(d_att, axis=-1, keepdims=True, out=rowsum)
        np.multiply(att, rowsum, out=att)  # the probabilities are not needed after this
        np.subtract(d_att, att, out=d_att)  # d_scores = p * (d_p - sum(p * d_p))
        np.matmul(d_att, ws["h_key"], out=ws["dh_query"])
        np.matmul(d_att.transpose(0, 1, 3, 2), ws["h_query"], out=ws["dh_key"])
        for name in _PROJ:
            dp, w = ws[f"dp_{name}"], self._width(name)
            np.copyto(dp.reshape(b, -1, h, w), ws[f"dh_{name}"].transpose(0, 2, 1, 3))
        dpq = ws["dp_query"]
        np.multiply(dpq, dpq.dtype.type(1.0 / np.sqrt(self.kd)), out=dpq)

    def backward_input(self, ws, dout, **p):
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

    def backward_weights(self, ws, dout, name, grad, rows):
        proj, part = name.rsplit("_", 1)
        if proj == "attention_output":
            src, d = ws["context"], dout.reshape(-1, self.out_shape[1])
        else:
            src, d = ws["inputs"][proj], ws[f"dp_{proj}"]
        if part == "kernel":
            product_rows(src, d, grad, rows, ws["row"][: d.shape[1]])
        else:
            ones = ws["ones"][: d.shape[0]].reshape(-1, 1)
            product_rows(ones, d, grad, rows, ws["row"][: d.shape[1]])
