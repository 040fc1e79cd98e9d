"""Registry entry of Keras' ``CategoryEncoding`` (``engine/ops/category.py``): integer ids of a
model input encoded one-hot, multi-hot or as counts. Only right after a model input (ids
have no gradient, the op has no backward); elsewhere, ``sparse=True`` (Keras 3 does not save it;
tf.keras 2 configs carry it) and ids of more than one
axis are refused by name. Exported as ONNX ``Equal`` against the token range, cast to float
and reduced over the ids for multi_hot / count."""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.category import CategoryEncode
from ringtrain_trainer.keras.entry import Args, Entry, Shape


def _parse(a: Args) -> dict:
    n = a.positive("num_tokens")
    mode = a.must_be("output_mode", "multi_hot", "one_hot", "count", "binary")
    a.must_be("sparse", False)
    a.done("num_tokens, output_mode (one_hot, multi_hot, count)")
    return {"num_tokens": n, "output_mode": "multi_hot" if mode == "binary" else mode}


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) != 1:
        raise ValueError(f"ids of shape {shapes[0]} are not supported (supported: (k,))")
    k, n = shapes[0][0], args["num_tokens"]
    return (k, n) if args["output_mode"] == "one_hot" and k > 1 else (n,)


def _build(spec, shapes, ctx):
    if spec.inputs[0] > 0:  # model inputs are tensors ≤ 0, layer outputs ≥ 1
        raise ValueError(
            "reads another layer's output; supported: right after a model input of "
            "integer ids (the encoding has no gradient)"
        )
    return CategoryEncode(shapes[0], spec.args["num_tokens"], spec.args["output_mode"])


def _onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    x = g.x(0, nchw=False)
    ids = g.op("Unsqueeze", [x, g.const(f"{n}_axis", np.array([-1], np.int64))], f"{n}_ids")
    tokens = np.arange(a["num_tokens"], dtype=np.float32)
    hot = g.op("Equal", [ids, g.const(f"{n}_tokens", tokens)], f"{n}_eq")
    hot = g.op("Cast", [hot], f"{n}_hot", to=g.onnx.TensorProto.FLOAT)
    axis = g.const(f"{n}_reduce", np.array([1], np.int64))
    if a["output_mode"] == "one_hot":
        if spec.out_shape == (a["num_tokens"],):
            hot = g.op("Squeeze", [hot, axis], f"{n}_one")
    elif a["output_mode"] == "multi_hot":
        hot = g.op("ReduceMax", [hot], f"{n}_multi", axes=[1], keepdims=0)
    else:
        hot = g.op("ReduceSum", [hot, axis], f"{n}_count", keepdims=0)
    g.out(g.op("Identity", [hot], n))


ENTRIES = {
    "CategoryEncoding": Entry(
        _parse,
        _build,
        _onnx,
        infer=_infer,
        doc="`num_tokens`, `output_mode` (one_hot, multi_hot, count); right after a model "
        "input of integer ids (k,); `sparse=False`",
    ),
}
