"""Registry entries of Keras' single-head attention layers, ``Attention`` (Luong) and
``AdditiveAttention`` (Bahdanau); their op is ``engine/ops/score_attention.py``.

Both are called on a list ``[query, value]`` or ``[query, value, key]``; the call's
``use_causal_mask`` is read like a config argument. Attention dropout (a random mask on the
softmax Keras draws from its own generator) and ``return_attention_scores`` (a second output)
are refused by name rather than run differently.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.score_attention import ScoreAttention
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight


def _parse(a: Args, cls: str) -> dict:
    a.trainable()
    args = {"use_scale": bool(a.take("use_scale", cls == "AdditiveAttention"))}
    if cls == "Attention":  # AdditiveAttention's config has none: its mode is its class
        args["score_mode"] = a.must_be("score_mode", "dot", "concat")
    dropout = a.take("dropout", 0.0)
    if dropout not in (0, 0.0):
        a.refuse("dropout", dropout, "0")
    a.take("seed")
    a.must_be("return_attention_scores", False)
    args["use_causal_mask"] = bool(a.take("use_causal_mask", False))  # the call's argument
    a.done("use_scale, score_mode, dropout=0; call: use_causal_mask")
    return args


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if not 2 <= len(shapes) <= 3 or any(len(s) != 2 for s in shapes):
        raise ValueError(
            f"inputs of shapes {shapes}: supported are [query, value] or [query, value, key], "
            "each (timesteps, features)"
        )
    q, v = shapes[0], shapes[1]
    k = shapes[2] if len(shapes) == 3 else v
    if k[0] != v[0] or k[1] != q[1]:
        raise ValueError(f"query {q}, value {v} and key {k} do not fit")
    return (q[0], v[1])


def _mode(args: dict) -> str:
    return args.get("score_mode", "additive")


def _weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    out = []
    if args["use_scale"]:
        out.append(Weight("scale", (shapes[0][-1],) if _mode(args) == "additive" else ()))
    if _mode(args) == "concat":
        out.append(Weight("concat_score_weight", ()))
    return out


def _build(spec, shapes, ctx):
    a = spec.args
    return ScoreAttention(shapes, _mode(a), a["use_scale"], a["use_causal_mask"])


def _onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    mode = _mode(a)
    names = [x.name for x in _weights(a, [tuple(s) for s in spec.in_shapes])]
    w = dict(zip(names, weights, strict=True))
    xs = [g.x(k, nchw=False) for k in range(len(spec.inputs))]
    q, v = xs[0], xs[1]
    k = xs[2] if len(xs) > 2 else v
    if mode == "dot":
        s = g.op("MatMul", [q, g.op("Transpose", [k], f"{n}_kt", perm=[0, 2, 1])], f"{n}_s")
        if a["use_scale"]:
            s = g.op("Mul", [s, g.const(f"{n}_scale", w["scale"])], f"{n}_scaled")
    else:
        qe = g.op("Unsqueeze", [q, g.const(f"{n}_ax2", np.array([2], np.int64))], f"{n}_q4")
        ke = g.op("Unsqueeze", [k, g.const(f"{n}_ax1", np.array([1], np.int64))], f"{n}_k4")
        t = g.op("Add", [qe, ke], f"{n}_qk")
        if mode == "concat" and a["use_scale"]:
            t = g.op("Mul", [t, g.const(f"{n}_scale", w["scale"])], f"{n}_qk_scaled")
        t = g.op("Tanh", [t], f"{n}_tanh")
        if mode == "additive" and a["use_scale"]:
            t = g.op("Mul", [t, g.const(f"{n}_scale", w["scale"])], f"{n}_tanh_scaled")
        axes = g.const(f"{n}_axes", np.array([-1], np.int64))
        s = g.op("ReduceSum", [t, axes], f"{n}_s", keepdims=0)
        if mode == "concat":
            c = g.const(f"{n}_concat_score_weight", w["concat_score_weight"])
            s = g.op("Mul", [s, c], f"{n}_s_weighted")
    if a["use_causal_mask"]:
        tq, tv = spec.in_shapes[0][0], spec.in_shapes[1][0]
        future = np.triu(np.full((tq, tv), 1e9, np.float32), 1)
        s = g.op("Sub", [s, g.const(f"{n}_future", future)], f"{n}_masked")
    p = g.op("Softmax", [s], f"{n}_probs", axis=-1)
    g.out(g.op("MatMul", [p, v], n))


def _entry(cls: str, doc: str) -> Entry:
    return Entry(
        lambda a: _parse(a, cls),
        _build,
        _onnx,
        infer=_infer,
        weights=_weights,
        inputs=0,
        call_args=("use_causal_mask", "return_attention_scores"),
        doc=doc,
    )


ENTRIES = {
    "Attention": _entry(
        "Attention",
        "`use_scale`, `score_mode` ('dot', 'concat'); [query, value] or [query, value, key] of "
        "(timesteps, features); the call's `use_causal_mask`; `dropout=0`",
    ),
    "AdditiveAttention": _entry(
        "AdditiveAttention",
        "`use_scale`; [query, value] or [query, value, key] of (timesteps, features); the "
        "call's `use_causal_mask`; `dropout=0`",
    ),
}
