"""Registry entries of the layers that act on any shape: Dense, Rescaling, Flatten, Reshape,
Dropout, BatchNormalization (the activation layers: ``layers_activation``)."""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.ops.batchnorm import BatchNorm
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.dropout import Dropout, SharedDropout
from ringtrain_trainer.engine.ops.elementwise import Elementwise
from ringtrain_trainer.engine.ops.scale import ChannelScale
from ringtrain_trainer.engine.ops.shape import Reshape
from ringtrain_trainer.engine.ranges import NON_NEGATIVE, UNIT
from ringtrain_trainer.keras import onnx_acts
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight, gamma_beta_weights
from ringtrain_trainer.keras.layers_window import ACTS, _activation


def _dense_parse(a: Args) -> dict:
    a.trainable()
    args = {
        "units": a.positive("units"),
        "activation": _activation(a),
        "use_bias": bool(a.take("use_bias", True)),
    }
    a.initializer("kernel_initializer", "glorot_uniform")
    a.initializer("bias_initializer", "zeros")
    a.nothing(
        "kernel_regularizer",
        "bias_regularizer",
        "activity_regularizer",
        "kernel_constraint",
        "bias_constraint",
        "lora_rank",
        "lora_alpha",
        "quantization_config",
    )
    a.done("units, activation, use_bias")
    return args


def _dense_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    n = args["units"]
    w = [Weight("kernel", (shapes[0][-1], n))]
    return w + ([Weight("bias", (n,))] if args["use_bias"] else [])


def _dense_build(spec, shapes, ctx):
    a = spec.args
    act = "linear" if ctx.fold and a["activation"] == ctx.fold else a["activation"]
    return Dense(shapes[0], a["units"], act, a["use_bias"])


def _dense_onnx(g, spec, weights) -> None:
    n = spec.name
    y = g.op("MatMul", [g.x(0, nchw=False), g.const(f"{n}_kernel", weights[0])], n)
    if spec.args["use_bias"]:
        y = g.op("Add", [y, g.const(f"{n}_bias", weights[1])], f"{n}_bias")
    g.out(onnx_acts.act(g, y, spec.args["activation"]))


def _rescaling_parse(a: Args) -> dict:
    args = {}
    for arg, default in (("scale", 1.0), ("offset", 0.0)):
        v = a.take(arg, default)
        one = isinstance(v, (int, float)) and not isinstance(v, bool)
        many = isinstance(v, (list, tuple)) and all(
            isinstance(i, (int, float)) and not isinstance(i, bool) for i in v
        )
        if not (one or (many and v)):
            a.refuse(arg, v, "a number or a list of one number per channel")
        args[arg] = float(v) if one else [float(i) for i in v]
    a.done("scale, offset")
    return args


def _rescaling_infer(args: dict, shapes: list[Shape]) -> Shape:
    c = shapes[0][-1] if shapes[0] else 1
    for k in ("scale", "offset"):
        if isinstance(args[k], list) and len(args[k]) not in (1, c):
            raise ValueError(f"{k} has {len(args[k])} values for {c} channels")
    return shapes[0]


def _rescaling_build(spec, shapes, ctx):
    a = spec.args
    if isinstance(a["scale"], float) and isinstance(a["offset"], float):
        return Elementwise(tuple(shapes[0]), scale=a["scale"], offset=a["offset"])
    return ChannelScale(shapes[0], a["scale"], a["offset"])


def _rescaling_onnx(g, spec, weights) -> None:
    n = spec.name
    y = g.op("Mul", [g.x(0), g.per_channel(f"{n}_scale", spec.args["scale"])], n)
    g.out(g.op("Add", [y, g.per_channel(f"{n}_offset", spec.args["offset"])], f"{n}_offset"))


def _flatten_parse(a: Args) -> dict:
    a.channels_last()
    a.done("none")
    return {"data_format": "channels_last"}


def _flatten_infer(args: dict, shapes: list[Shape]) -> Shape:
    if "target_shape" not in args:
        return (math.prod(shapes[0]),)
    t, shape = list(args["target_shape"]), shapes[0]
    if t.count(-1) == 1:
        known = math.prod(d for d in t if d != -1)
        t[t.index(-1)] = math.prod(shape) // max(known, 1)
    if t.count(-1) or any(d < 1 for d in t) or math.prod(t) != math.prod(shape):
        want = list(args["target_shape"])
        raise ValueError(f"target_shape {want} does not fit its input {shape}")
    return tuple(t)


def _reshape_parse(a: Args) -> dict:
    t = a.take("target_shape")
    if not isinstance(t, (list, tuple)) or not all(isinstance(i, int) for i in t):
        a.refuse("target_shape", t, "a list of ints (-1 for one inferred axis)")
    a.done("target_shape")
    return {"target_shape": list(t)}


def _reshape_build(spec, shapes, ctx):
    return Reshape(tuple(shapes[0]), spec.out_shape)


def _reshape_onnx(g, spec, weights) -> None:
    target = [0, *spec.out_shape] if "target_shape" in spec.args else [0, -1]
    g.nchw = False
    shape = g.const(f"{spec.name}_shape", _int64(target))
    g.out(g.op("Reshape", [g.x(0, nchw=False), shape], spec.name))


def _int64(v):
    return np.array(v, np.int64)


def _dropout_parse(a: Args) -> dict:
    rate = a.take("rate")
    if not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        a.refuse("rate", rate, "a number in [0, 1)")
    args: dict = {"rate": float(rate)}
    noise = a.take("noise_shape")
    if noise is not None:
        ok = isinstance(noise, (list, tuple)) and len(noise) >= 2 and noise[0] is None
        if not ok or not all(n is None or (isinstance(n, int) and n >= 1) for n in noise[1:]):
            a.refuse("noise_shape", noise, "None for the batch, then None or an int per axis")
        args["noise_shape"] = list(noise)
    if a.cls.startswith("SpatialDropout"):
        args["data_format"] = a.channels_last()
    a.take("seed")  # ringtrain's masks come from --seed, the step and the example
    a.done("rate, noise_shape")
    return args


def _noise(spec, shape: Shape) -> tuple[int, ...] | None:
    """The mask's per-example shape (1 on the axes it is shared along), None: one per value."""
    if spec.cls.startswith("SpatialDropout"):
        return (*(1,) * (len(shape) - 1), shape[-1])
    noise = spec.args.get("noise_shape")
    if noise is None:
        return None
    if len(noise) != len(shape) + 1:
        raise ValueError(f"noise_shape {noise} has not the rank of the input {shape} + batch")
    return tuple(d if n is None else n for n, d in zip(noise[1:], shape, strict=True))


def _dropout_infer(args: dict, shapes: list[Shape]) -> Shape:
    noise = args.get("noise_shape")
    if noise is not None and len(noise) != len(shapes[0]) + 1:
        raise ValueError(f"noise_shape {noise} has not the rank of the input {shapes[0]} + batch")
    return shapes[0]


def _dropout_build(spec, shapes, ctx):
    noise = _noise(spec, tuple(shapes[0]))
    if noise is None or noise == tuple(shapes[0]):
        return Dropout(tuple(shapes[0]), spec.args["rate"], ctx.index)
    return SharedDropout(tuple(shapes[0]), spec.args["rate"], ctx.index, noise)


def _need_rank(rank: int):
    def infer(args: dict, shapes: list[Shape]) -> Shape:
        if len(shapes[0]) != rank:
            raise ValueError(f"needs an input of {rank} axes besides the batch, got {shapes[0]}")
        return shapes[0]

    return infer


def _identity_onnx(g, spec, weights) -> None:
    g.out(g.x(0))  # the identity at inference


def _bn_parse(a: Args) -> dict:
    a.trainable()
    axis = a.must_be("axis", -1, 3, [-1], [3])
    args = {
        "axis": axis[0] if isinstance(axis, list) else axis,
        "momentum": a.number("momentum", 0.99, UNIT),
        "epsilon": a.number("epsilon", 1e-3, NON_NEGATIVE),
        "center": bool(a.take("center", True)),
        "scale": bool(a.take("scale", True)),
    }
    for arg, default in (
        ("beta_initializer", "zeros"),
        ("gamma_initializer", "ones"),
        ("moving_mean_initializer", "zeros"),
        ("moving_variance_initializer", "ones"),
    ):
        a.initializer(arg, default)
    a.nothing(
        "beta_regularizer",
        "gamma_regularizer",
        "beta_constraint",
        "gamma_constraint",
        "renorm_clipping",
        "adjustment",
        "virtual_batch_size",
    )
    a.must_be("synchronized", False)
    a.must_be("renorm", False)
    a.must_be("fused", None, True, False)
    a.take("renorm_momentum")
    a.done("axis=-1, momentum, epsilon, center, scale")
    return args


def _bn_infer(args: dict, shapes: list[Shape]) -> Shape:
    if args["axis"] not in (-1, len(shapes[0])):
        raise ValueError(f"axis={args['axis']} is not the channel axis of {shapes[0]}")
    return shapes[0]


def _bn_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    c = (shapes[0][-1],)
    stats = [Weight("moving_mean", c, False), Weight("moving_variance", c, False)]
    return [*gamma_beta_weights(args, shapes), *stats]


def _bn_build(spec, shapes, ctx):
    a = spec.args
    return BatchNorm(tuple(shapes[0]), a["momentum"], a["epsilon"], a["center"], a["scale"])


def _bn_onnx(g, spec, weights) -> None:
    a, n, w = spec.args, spec.name, list(weights)
    gamma = w.pop(0) if a["scale"] else 1.0
    beta = w.pop(0) if a["center"] else 0.0
    mean, var = w
    k = gamma / np.sqrt(var + np.float32(a["epsilon"]))
    y = g.op("Mul", [g.x(0), g.per_channel(f"{n}_a", k)], n)
    g.out(g.op("Add", [y, g.per_channel(f"{n}_b", beta - mean * k)], f"{n}_b"))


ENTRIES = {
    "Dense": Entry(
        _dense_parse,
        _dense_build,
        _dense_onnx,
        infer=lambda args, shapes: (*shapes[0][:-1], args["units"]),
        weights=_dense_weights,
        doc="`units`, " + ACTS + ", `use_bias`; any rank (the kernel on the last axis)",
    ),
    "BatchNormalization": Entry(
        _bn_parse,
        _bn_build,
        _bn_onnx,
        infer=_bn_infer,
        weights=_bn_weights,
        doc="`momentum`, `epsilon`, `center`, `scale`, channel axis; batch statistics per "
        "replica, moving statistics as state",
    ),
    "Flatten": Entry(
        _flatten_parse, _reshape_build, _reshape_onnx, infer=_flatten_infer, doc="channels last"
    ),
    "Reshape": Entry(
        _reshape_parse,
        _reshape_build,
        _reshape_onnx,
        infer=_flatten_infer,
        doc="`target_shape` (one -1 inferred)",
    ),
    "Rescaling": Entry(
        _rescaling_parse,
        _rescaling_build,
        _rescaling_onnx,
        infer=_rescaling_infer,
        doc="`scale`, `offset`: a number or one per channel",
    ),
    "Dropout": Entry(
        _dropout_parse,
        _dropout_build,
        _identity_onnx,
        infer=_dropout_infer,
        doc="`rate`, `noise_shape`; masks from `--seed`, the step and the global example (any "
        "worker count)",
    ),
    **{
        cls: Entry(
            _dropout_parse,
            _dropout_build,
            _identity_onnx,
            infer=_need_rank(rank),
            takes_trainable=False,
            doc="`rate`; one mask value per example and channel, as `Dropout`'s",
        )
        for cls, rank in (("SpatialDropout1D", 2), ("SpatialDropout2D", 3))
    },
}
