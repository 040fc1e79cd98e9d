"""Registry entry of Keras ``Normalization`` (its op: ``engine/ops/standardize.py``): the
per-channel standardization EfficientNet and ConvNeXt open with, statistics either in the
config or in the layer's non-trainable weights (``mean``, ``variance``, ``count``)."""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.standardize import EPSILON, Standardize
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight


def _stats(a: Args, arg: str):
    v = a.take(arg)
    ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    ok = ok or (isinstance(v, (list, tuple)) and all(isinstance(i, (int, float)) for i in v))
    if not ok:
        a.refuse(arg, v, "None (weights), a number or one number per channel")
    return list(v) if isinstance(v, (list, tuple)) else v


def _parse(a: Args) -> dict:
    axis = a.take("axis", -1)
    axis = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    if not isinstance(axis, int) or isinstance(axis, bool):
        a.refuse("axis", axis, "the channel axis (-1)")
    a.must_be("invert", False)
    args = {"axis": axis, "mean": _stats(a, "mean"), "variance": _stats(a, "variance")}
    if (args["mean"] is None) != (args["variance"] is None):
        a.refuse("mean", args["mean"], "mean and variance both given or both None")
    a.done("axis=-1, mean, variance")
    return args


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if args["axis"] not in (-1, len(shapes[0])):
        raise ValueError(f"axis={args['axis']} is not the channel axis of {shapes[0]}")
    c = shapes[0][-1]
    for k in ("mean", "variance"):
        if isinstance(args[k], list) and len(args[k]) not in (1, c):
            raise ValueError(f"{k} has {len(args[k])} values for {c} channels")
    return shapes[0]


def _weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    if args["mean"] is not None:
        return []
    c = (shapes[0][-1],)
    return [
        Weight("mean", c, False),
        Weight("variance", c, False),
        Weight("count", (), False, dtype="int64"),
    ]


def _build(spec, shapes, ctx):
    return Standardize(shapes[0], spec.args["mean"], spec.args["variance"])


def _onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    mean, var = (a["mean"], a["variance"]) if a["mean"] is not None else weights[:2]
    c = spec.in_shapes[0][-1]
    mean = np.broadcast_to(np.asarray(mean, np.float32), (c,))
    std = np.maximum(np.sqrt(np.asarray(var, np.float32)), np.float32(EPSILON))
    inv = np.broadcast_to(np.float32(1) / std, (c,))
    y = g.op("Sub", [g.x(0), g.per_channel(f"{n}_mean", mean)], n)
    g.out(g.op("Mul", [y, g.per_channel(f"{n}_inv", inv)], f"{n}_inv"))


ENTRIES = {
    "Normalization": Entry(
        _parse,
        _build,
        _onnx,
        infer=_infer,
        weights=_weights,
        doc="`axis=-1`, `mean`/`variance` in the config or as the layer's (adapted) weights, "
        "held fixed as Keras' `fit` does",
    ),
}
