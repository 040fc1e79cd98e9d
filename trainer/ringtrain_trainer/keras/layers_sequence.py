"""Registry entries of the sequence and attention layers: Embedding, LayerNormalization,
MultiHeadAttention (the recurrent ones are ``layers_recurrent``). Their ops are
``engine/ops/{embedding,norm,attention}.py``.

Weights nested in Keras sub-layers (attention's ``query_dense``, an RNN's ``cell``) name
their ``model.weights.h5`` group in :attr:`Weight.group`. Initializers are read only to refuse
one ringtrain would not honour: training starts from the ``.keras`` file's own weights; a
config without weights starts from Glorot kernels (``model.init``), as the trainer does for
every layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.attention import MultiHeadAttention
from ringtrain_trainer.engine.ops.embedding import Embedding
from ringtrain_trainer.engine.ops.mask import ApplyMask
from ringtrain_trainer.engine.ops.norm import LayerNorm
from ringtrain_trainer.engine.ranges import NON_NEGATIVE
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight, gamma_beta_weights

_FREE = ("activity_regularizer", "lora_rank", "lora_alpha", "quantization_config")


def no(a: Args, *args: str) -> None:
    a.nothing(*args, *_FREE)


# -- Embedding --------------------------------------------------------------------------------
def _embedding_parse(a: Args) -> dict:
    a.trainable()
    args = {"input_dim": a.positive("input_dim"), "output_dim": a.positive("output_dim")}
    a.initializer("embeddings_initializer", "RandomUniform")
    args["mask_zero"] = bool(a.take("mask_zero", False))  # the mask: ``keras.masks``
    a.must_be("sparse", False)
    a.take("input_length")  # tf.keras 2's shape hint; the input shape is the InputLayer's
    no(a, "embeddings_regularizer", "embeddings_constraint")
    a.done("input_dim, output_dim")
    return args


def _embedding_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    return [Weight("embeddings", (args["input_dim"], args["output_dim"]))]


def _embedding_build(spec, shapes, ctx):
    return Embedding(shapes[0], spec.args["input_dim"], spec.args["output_dim"])


# -- Masking ------------------------------------------------------------------------------------
def _masking_parse(a: Args) -> dict:
    v = a.take("mask_value", 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        a.refuse("mask_value", v, "a number")
    a.done("mask_value")
    return {"mask_value": float(v)}


def _masking_build(spec, shapes, ctx):
    return ApplyMask(shapes[0])


def _masking_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) < 2:
        raise ValueError(f"needs an input of (timesteps, ..., features), got {shapes[0]}")
    return shapes[0]


def _masked_onnx(g, spec, weights) -> None:
    raise InvalidSpec(f"export: layer {spec.name!r} ({spec.cls}): Keras masks have no ONNX here")


def _embedding_onnx(g, spec, weights) -> None:
    ids = g.op("Cast", [g.x(0, nchw=False)], f"{spec.name}_ids", to=g.onnx.TensorProto.INT64)
    g.out(g.op("Gather", [g.const(f"{spec.name}_embeddings", weights[0]), ids], spec.name))


# -- LayerNormalization ------------------------------------------------------------------------
def _ln_parse(a: Args) -> dict:
    a.trainable()
    axis = a.take("axis", -1)
    args = {
        "axis": axis[0] if isinstance(axis, list) and len(axis) == 1 else axis,
        "epsilon": a.number("epsilon", 1e-3, NON_NEGATIVE),
        "center": bool(a.take("center", True)),
        "scale": bool(a.take("scale", True)),
    }
    if not isinstance(args["axis"], int):
        a.refuse("axis", axis, "the last axis (-1)")
    a.must_be("rms_scaling", False)
    a.initializer("beta_initializer", "Zeros")
    a.initializer("gamma_initializer", "Ones")
    no(a, "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint")
    a.done("axis=-1, epsilon, center, scale")
    return args


def _ln_infer(args: dict, shapes: list[Shape]) -> Shape:
    if args["axis"] not in (-1, len(shapes[0])):
        raise ValueError(f"axis={args['axis']} is not the last axis of {shapes[0]} (supported: -1)")
    return shapes[0]


def _ln_build(spec, shapes, ctx):
    a = spec.args
    return LayerNorm(shapes[0], a["epsilon"], a["center"], a["scale"])


def _ln_onnx(g, spec, weights) -> None:
    a, n, w = spec.args, spec.name, list(weights)
    d = spec.out_shape[-1]
    gamma = w.pop(0) if a["scale"] else np.ones(d, np.float32)
    beta = w.pop(0) if a["center"] else np.zeros(d, np.float32)
    x = g.x(0, nchw=False)
    ins = [x, g.const(f"{n}_gamma", gamma), g.const(f"{n}_beta", beta)]
    g.out(g.op("LayerNormalization", ins, n, axis=-1, epsilon=a["epsilon"]))


# -- MultiHeadAttention -------------------------------------------------------------------------
_PROJ = ("query", "key", "value")


def _mha_parse(a: Args) -> dict:
    a.trainable()
    args: dict[str, Any] = {
        "num_heads": a.positive("num_heads"),
        "key_dim": a.positive("key_dim"),
        "use_bias": bool(a.take("use_bias", True)),
    }
    vd = a.take("value_dim")
    args["value_dim"] = args["key_dim"] if vd is None else vd
    if not isinstance(args["value_dim"], int) or args["value_dim"] < 1:
        a.refuse("value_dim", vd, "a positive int or None")
    args["use_causal_mask"] = bool(a.take("use_causal_mask", False))  # the call's argument
    dropout = a.take("dropout", 0.0)
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        a.refuse("dropout", dropout, "a rate in [0, 1)")
    args["dropout"] = float(dropout)
    axes = a.take("attention_axes")
    if axes not in (None, [1], (1,), 1, [-2]):
        a.refuse("attention_axes", axes, "None (attention over the sequence axis)")
    a.nothing("output_shape", "sliding_window")
    a.must_be("use_gate", False)
    a.must_be("flash_attention", None, False)
    a.take("seed")
    a.initializer("kernel_initializer", "GlorotUniform")
    a.initializer("bias_initializer", "Zeros")
    no(a, "kernel_regularizer", "bias_regularizer", "kernel_constraint", "bias_constraint")
    a.done("num_heads, key_dim, value_dim, use_bias, dropout; call: use_causal_mask")
    return args


def _mha_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes) > 3 or any(len(s) != 2 for s in shapes):
        raise ValueError(
            f"inputs of shapes {shapes}: supported are query, value and an optional key, "
            "each (timesteps, features)"
        )
    if len(shapes) == 3 and shapes[1][0] != shapes[2][0]:
        raise ValueError(f"key length {shapes[2][0]} differs from value length {shapes[1][0]}")
    return shapes[0]


def _mha_dims(shapes: list[Shape]) -> dict[str, int]:
    v = shapes[1]
    k = shapes[2] if len(shapes) > 2 else v
    return {"query": shapes[0][-1], "key": k[-1], "value": v[-1]}


def _mha_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    h, dims, out = args["num_heads"], _mha_dims(shapes), []
    for p in _PROJ:
        w = args["value_dim"] if p == "value" else args["key_dim"]
        out.append(Weight(f"{p}_kernel", (dims[p], h, w), group=f"{p}_dense"))
        if args["use_bias"]:
            out.append(Weight(f"{p}_bias", (h, w), group=f"{p}_dense"))
    d = shapes[0][-1]
    out.append(Weight("attention_output_kernel", (h, args["value_dim"], d), group="output_dense"))
    if args["use_bias"]:
        out.append(Weight("attention_output_bias", (d,), group="output_dense"))
    return out


def _mha_build(spec, shapes, ctx):
    a = spec.args
    return MultiHeadAttention(
        shapes,
        a["num_heads"],
        a["key_dim"],
        a["value_dim"],
        a["use_bias"],
        causal=a["use_causal_mask"],
        mask_input=bool(ctx.mask),
        dropout=a.get("dropout", 0.0),
        index=ctx.index,
    )


def _mha_onnx(g, spec, weights) -> None:
    a, n, shapes = spec.args, spec.name, [tuple(s) for s in spec.in_shapes]
    h, kd, vd = a["num_heads"], a["key_dim"], a["value_dim"]
    w = dict(zip([x.name for x in _mha_weights(a, list(shapes))], weights, strict=True))
    xs = [g.x(k, nchw=False) for k in range(len(spec.inputs))]
    src = {"query": xs[0], "value": xs[1], "key": xs[2] if len(xs) > 2 else xs[1]}
    heads = {}
    for p in _PROJ:
        width = vd if p == "value" else kd
        kern = w[f"{p}_kernel"].reshape(-1, h * width)
        y = g.op("MatMul", [src[p], g.const(f"{n}_{p}_kernel", kern)], f"{n}_{p}")
        if a["use_bias"]:
            y = g.op("Add", [y, g.const(f"{n}_{p}_bias", w[f"{p}_bias"].reshape(-1))], f"{n}_{p}_b")
        if p == "query":
            y = g.op("Mul", [y, g.const(f"{n}_scale", np.float32(1 / np.sqrt(kd)))], f"{n}_q_s")
        shape = g.const(f"{n}_{p}_shape", np.array([0, -1, h, width], np.int64))
        y = g.op("Reshape", [y, shape], f"{n}_{p}_heads")
        perm = [0, 2, 3, 1] if p == "key" else [0, 2, 1, 3]
        heads[p] = g.op("Transpose", [y], f"{n}_{p}_t", perm=perm)
    s = g.op("MatMul", [heads["query"], heads["key"]], f"{n}_scores")
    if a["use_causal_mask"]:
        t, k = shapes[0][0], shapes[1][0]
        keep = np.tril(np.ones((t, k), bool))
        s = g.op(
            "Where",
            [g.const(f"{n}_causal", keep), s, g.const(f"{n}_masked", np.float32(-1e9))],
            f"{n}_masked_scores",
        )
    p_ = g.op("Softmax", [s], f"{n}_probs", axis=-1)
    c = g.op("MatMul", [p_, heads["value"]], f"{n}_context")
    c = g.op("Transpose", [c], f"{n}_context_t", perm=[0, 2, 1, 3])
    c = g.op("Reshape", [c, g.const(f"{n}_cshape", np.array([0, 0, h * vd], np.int64))], f"{n}_c")
    wo = w["attention_output_kernel"].reshape(h * vd, -1)
    y = g.op("MatMul", [c, g.const(f"{n}_output_kernel", wo)], f"{n}_out")
    if a["use_bias"]:
        y = g.op("Add", [y, g.const(f"{n}_output_bias", w["attention_output_bias"])], f"{n}_ob")
    g.out(y)


ENTRIES = {
    "Embedding": Entry(
        _embedding_parse,
        _embedding_build,
        _embedding_onnx,
        infer=lambda args, shapes: (*shapes[0], args["output_dim"]),
        weights=_embedding_weights,
        doc="`input_dim`, `output_dim`; int token ids of any shape (an `int32` input); "
        "`mask_zero` (the mask of Keras 3: RNNs skip, GlobalAveragePooling1D and attention "
        "ignore masked timesteps; merges AND masks; layers without Keras masking drop it)",
    ),
    "Masking": Entry(
        _masking_parse,
        _masking_build,
        _masked_onnx,
        infer=_masking_infer,
        takes_trainable=True,
        doc="`mask_value`: zeroes and masks timesteps whose features all equal it (no ONNX)",
    ),
    "LayerNormalization": Entry(
        _ln_parse,
        _ln_build,
        _ln_onnx,
        infer=_ln_infer,
        weights=gamma_beta_weights,
        doc="`epsilon`, `center`, `scale`; the last axis; `rms_scaling=False`",
    ),
    "MultiHeadAttention": Entry(
        _mha_parse,
        _mha_build,
        _mha_onnx,
        infer=_mha_infer,
        weights=_mha_weights,
        inputs=0,
        call_args=("use_causal_mask",),
        positional=True,
        doc="`num_heads`, `key_dim`, `value_dim`, `use_bias`; query, value and optional key of "
        "(timesteps, features); the call's `use_causal_mask`; the Keras masks of query, value "
        "and key (with the causal mask); `dropout` (on the attention probabilities, training "
        "only)",
    ),
}
