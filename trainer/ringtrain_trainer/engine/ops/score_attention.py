"""Keras' single-head attention layers: ``Attention`` (Luong: dot-product scores, or
``score_mode="concat"``) and ``AdditiveAttention`` (Bahdanau). ``query (b, Tq, d)``,
``value (b, Tv, dv)``, optional ``key (b, Tv, d)`` (key defaults to value) → ``(b, Tq, dv)``.

Unlike ``MultiHeadAttention`` these have no projections: the scores are computed from the
inputs themselves, then ``softmax(scores) @ value``. Keras' arithmetic, mode by mode:

* ``dot``: ``s = q @ kᵀ``, times the scalar ``scale`` when ``use_scale``;
* ``concat``: ``s = c · Σ_d tanh(a · (q_i + k_j))`` with the scalar ``concat_score_weight``
  ``c`` and ``a`` the scalar ``scale`` (1 without ``use_scale``);
* ``additive``: ``s = Σ_d scale_d · tanh(q_i + k_j)``, the vector ``scale`` (ones without it).

``use_causal_mask`` subtracts 1e9 from the scores of keys after the query (Keras subtracts,
it does not overwrite, so the gradient flows through unchanged and vanishes in the softmax).
The tanh modes keep a ``(b, Tq, Tv, d)`` tensor from forward for backward.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.attention import keys_major, softmax_keys
from ringtrain_trainer.engine.tensor import ParamSpec

#: Keras' ``max_value`` subtracted from masked float32 scores
MASKED = 1e9
MODES = ("dot", "concat", "additive")


class ScoreAttentionWs(TypedDict, total=False):
    """The buffers :class:`ScoreAttention` is compiled with (``buffers``, its state, ``bind``)."""

    att: np.ndarray
    c: float
    d_att: np.ndarray
    dkey: np.ndarray
    dx0: np.ndarray
    dx1: np.ndarray
    dx2: np.ndarray
    dz: np.ndarray
    future: np.ndarray
    out: np.ndarray
    qkv: tuple[np.ndarray, np.ndarray, np.ndarray]
    raw: np.ndarray
    rowsum: np.ndarray
    scores: np.ndarray
    t: np.ndarray
    x: np.ndarray


class ScoreAttention(Op):
    """``in_shapes``: the per-example ``(T, features)`` shapes of query, value and optional
    key, one per input the node reads (the same tensor may come twice: the engine sums)."""

    kind = "attention"

    def __init__(self, in_shapes, mode: str = "dot", use_scale: bool = False, causal=False):
        shapes = [tuple(s) for s in in_shapes]
        if not 2 <= len(shapes) <= 3 or any(len(s) != 2 for s in shapes):
            raise ValueError(f"attention: 2-3 inputs of shape (T, d), got {shapes}")
        if mode not in MODES:
            raise ValueError(f"attention: mode {mode!r} not in {MODES}")
        q, v = shapes[0], shapes[1]
        k = shapes[2] if len(shapes) == 3 else v
        if k[0] != v[0] or k[1] != q[1]:
            raise ValueError(f"attention: query {q}, value {v}, key {k} do not fit")
        self.in_shapes, self.n_inputs = shapes, len(shapes)
        self.in_shape = q
        self.Tq, self.Tv, self.d = q[0], v[0], q[1]
        self.out_shape = (q[0], v[1])
        self.mode, self.use_scale, self.causal = mode, use_scale, causal

    def params(self, layer):
        ps = []
        if self.use_scale and self.mode == "additive":
            ps.append(ParamSpec(layer, "scale", (self.d,), self.d, self.d, True))
        elif self.use_scale:
            ps.append(ParamSpec(layer, "scale", (), 0, 0, False, ones=True))
        if self.mode == "concat":
            ps.append(ParamSpec(layer, "concat_score_weight", (), 0, 0, False, ones=True))
        return ps

    def buffers(self, b, train, need_dx):
        Tq, Tv, d = self.Tq, self.Tv, self.d
        bufs = {
            "out": ((b, *self.out_shape), "f"),
            "scores": ((Tv, b, Tq), "f"),  # keys-major (``softmax_keys``); "att" views it
            "raw": ((b, Tq, Tv), "f"),
            "rowsum": ((b * Tq,), "f"),
        }
        if self.mode != "dot":
            bufs["t"] = ((b, Tq, Tv, d), "f")
        if self.causal:
            bufs["future"] = ((1, Tq, Tv), "f")
        if train:
            bufs["d_att"] = ((b, Tq, Tv), "f")
            if self.mode != "dot":
                bufs["dz"] = ((b, Tq, Tv, d), "f")
            if self.mode == "concat" and self.use_scale:
                bufs["x"] = ((b, Tq, Tv, d), "f")
            if need_dx:
                for k, s in enumerate(self.in_shapes):
                    bufs[f"dx{k}"] = ((b, *s), "f")
                if self.n_inputs == 2:
                    bufs["dkey"] = ((b, Tv, d), "f")
        return bufs

    def flops(self, b, train, need_dx):
        Tq, Tv, d, dv = self.Tq, self.Tv, self.d, self.out_shape[1]
        fwd = 2 * b * Tq * Tv * (dv + (d if self.mode == "dot" else 3 * d))
        return fwd * (3 if train else 1)

    def bind(self, ws: ScoreAttentionWs, b):
        ws["att"] = keys_major(ws["scores"])
        if self.causal:
            t, s = np.indices((self.Tq, self.Tv))
            np.copyto(ws["future"][0], np.where(s > t, MASKED, 0.0))

    def forward(self, ws: ScoreAttentionWs, *xs, **p):
        q, v = xs[0], xs[1]
        k = xs[2] if len(xs) > 2 else v
        raw, att = ws["raw"], ws["att"]
        if self.mode == "dot":
            np.matmul(q, k.transpose(0, 2, 1), out=raw)
        else:
            t = ws["t"]
            np.add(q[:, :, None, :], k[:, None, :, :], out=t)
            if self.mode == "concat" and self.use_scale:
                if "x" in ws:
                    np.copyto(ws["x"], t)
                np.multiply(t, p["scale"], out=t)
            np.tanh(t, out=t)
            if self.mode == "additive" and self.use_scale:
                np.matmul(t, p["scale"], out=raw)
            else:
                np.sum(t, axis=-1, out=raw)
        # the scalar outside the sum: dot's scale, concat's score weight (additive has none)
        weight = p["concat_score_weight"] if self.mode == "concat" else p.get("scale")
        if self.mode != "additive" and weight is not None:
            np.multiply(raw, weight, out=att)
        else:
            np.copyto(att, raw)
        if self.causal:
            np.subtract(att, ws["future"], out=att)
        softmax_keys(ws["scores"].reshape(self.Tv, -1), ws["rowsum"])
        ws["qkv"] = (q, k, v)
        if self.mode == "concat":
            ws["c"] = float(p["concat_score_weight"])
        return np.matmul(att, v, out=ws["out"])

    def backward_local(self, ws: ScoreAttentionWs, dout):
        """The scores' gradient into ``d_att`` and, for the tanh modes, the gradient at the
        tanh's input into ``dz`` (the scales not yet applied): both halves read them."""
        att, d_att = ws["att"], ws["d_att"]
        rowsum = ws["rowsum"].reshape(*att.shape[:2], 1)  # (b, Tq, 1)
        np.matmul(dout, ws["qkv"][2].transpose(0, 2, 1), out=d_att)
        np.einsum("bij,bij->bi", d_att, att, out=rowsum[..., 0])
        np.subtract(d_att, rowsum, out=d_att)
        np.multiply(d_att, att, out=d_att)  # d_scores = p * (d_p - sum(p * d_p))
        if self.mode != "dot":
            t, dz = ws["t"], ws["dz"]
            np.multiply(t, t, out=dz)
            np.subtract(1.0, dz, out=dz)
            np.multiply(dz, d_att[..., None], out=dz)

    def _tanh_factor(self, p):
        """What multiplies ``dz`` on its way to q and k: the additive mode's scale vector, or
        the concat mode's ``c · a``."""
        if self.mode == "additive":
            return p["scale"] if self.use_scale else 1.0
        return p["concat_score_weight"] * (p["scale"] if self.use_scale else 1.0)

    def backward_input(self, ws: ScoreAttentionWs, dout, **p):
        q, k, _ = ws["qkv"]
        att, d_att = ws["att"], ws["d_att"]
        dq, dv = ws["dx0"], ws["dx1"]
        dk = ws["dx2"] if self.n_inputs == 3 else ws["dkey"]
        np.matmul(att.transpose(0, 2, 1), dout, out=dv)
        if self.mode == "dot":
            np.matmul(d_att, k, out=dq)
            np.matmul(d_att.transpose(0, 2, 1), q, out=dk)
            if self.use_scale:
                np.multiply(dq, p["scale"], out=dq)
                np.multiply(dk, p["scale"], out=dk)
        else:
            dz, f = ws["dz"], self._tanh_factor(p)
            np.sum(dz, axis=2, out=dq)
            np.sum(dz, axis=1, out=dk)
            np.multiply(dq, f, out=dq)
            np.multiply(dk, f, out=dk)
        if self.n_inputs == 2:  # the value is also the key: its two gradients add
            np.add(dv, dk, out=dv)
            return dq, dv
        return dq, dv, dk

    def backward_weights(self, ws: ScoreAttentionWs, dout, name, grad, rows):
        d_att = ws["d_att"]
        if name == "concat_score_weight" or self.mode == "dot":
            grad[...] = np.vdot(d_att, ws["raw"])  # s = w · raw
        elif self.mode == "additive":
            np.einsum("bijd,bij->d", ws["t"], d_att, out=grad)
        else:  # concat's scale a, inside tanh(a · x): dz · x, times c
            grad[...] = np.vdot(ws["dz"], ws["x"]) * ws["c"]
