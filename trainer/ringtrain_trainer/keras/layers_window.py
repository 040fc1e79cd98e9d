"""Registry entries of the window layers beyond Conv2D and the 2-D poolings: Conv1D, Conv3D,
DepthwiseConv1D/2D, SeparableConv1D/2D (any padding, strides, dilation, every activation of
``engine.ops.activations``), Max/AveragePooling1D/3D and GlobalMax/GlobalAveragePooling1D/2D/3D.

Channels last; their ops live in ``engine/ops/{conv,depthwise,pool}.py``, whose padding
arithmetic (``engine.ops.window.pad_1d``, pure Python) also gives the shapes here. ONNX: a
1-D or 3-D layer is transposed to channels first around its node; depthwise convolution is
``Conv`` with ``group`` = channels; the global poolings reduce the channels-last tensor directly.
"""

from __future__ import annotations

from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.depthwise import Depthwise, Separable
from ringtrain_trainer.engine.ops.groupconv import depthwise_or_grouped
from ringtrain_trainer.engine.ops.pool import GlobalPool, Pool
from ringtrain_trainer.engine.ops.window import pad_1d
from ringtrain_trainer.keras import onnx_acts
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight

#: every activation the window ops run (``engine.ops.activations``; a test keeps them equal)
ACTIVATIONS = onnx_acts.NAMES
ACTS = f"`activation` (any of {len(ACTIVATIONS)}: relu, gelu, swish, elu, selu, mish, ...)"
_CONSTRAINTS = (
    "activity_regularizer",
    "bias_constraint",
    "bias_regularizer",
    "lora_rank",
    "lora_alpha",
)


def _ints(a: Args, arg: str, rank: int, default) -> list[int]:
    v = a.take(arg, default)
    v = [v] * rank if isinstance(v, int) else list(v) if isinstance(v, list | tuple) else [v]
    if len(v) != rank or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in v
    ):
        a.refuse(arg, v, f"a positive int or {rank} of them")
    return v


def _activation(a: Args) -> str:
    v = a.take("activation", "linear")
    if isinstance(v, dict):  # a serialized function
        v = v.get("config") if isinstance(v.get("config"), str) else v.get("class_name")
    v = "linear" if v is None else v
    if v not in ACTIVATIONS:
        a.refuse("activation", v, ", ".join(ACTIVATIONS))
    return v


def groups(a: Args, args: dict) -> None:
    """Keras' ``groups``: kept in ``args`` only when > 1 (what 1 exports stays unchanged)."""
    v = a.take("groups", 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        a.refuse("groups", v, "a positive int dividing the input channels and filters")
    if v > 1:
        args["groups"] = v


def check_groups(args: dict, shape: Shape) -> None:
    """The shape check ``groups`` needs (Keras refuses the same at build)."""
    n = args.get("groups", 1)
    if shape[-1] % n or args["filters"] % n:
        raise ValueError(
            f"groups={n} must divide the input channels ({shape[-1]}) and filters "
            f"({args['filters']})"
        )


def _conv_parse(a: Args) -> dict:
    rank = int(a.cls[-2])
    depthwise, separable = a.cls.startswith("Depthwise"), a.cls.startswith("Separable")
    a.trainable()
    args: dict = {}
    if not depthwise:
        args["filters"] = a.positive("filters")
    if depthwise or separable:
        args["depth_multiplier"] = (
            a.positive("depth_multiplier") if "depth_multiplier" in a.cfg else 1
        )
    paddings = ("valid", "same", "causal") if a.cls == "Conv1D" else ("valid", "same")
    args.update(
        kernel_size=_ints(a, "kernel_size", rank, None),
        strides=_ints(a, "strides", rank, 1),
        padding=a.must_be("padding", *paddings),
        data_format=a.channels_last(),
        dilation_rate=_ints(a, "dilation_rate", rank, 1),
        activation=_activation(a),
        use_bias=bool(a.take("use_bias", True)),
    )
    if max(args["strides"]) > 1 and max(args["dilation_rate"]) > 1:
        a.refuse("dilation_rate", args["dilation_rate"], "1 when strides > 1 (as Keras)")
    if not (depthwise or separable):
        groups(a, args)
        if rank == 3 and args.get("groups", 1) > 1:
            a.refuse("groups", args["groups"], "1 for Conv3D")
    kernels = ["depthwise", "pointwise"] if separable else ["depthwise" if depthwise else "kernel"]
    for k in kernels:
        a.initializer(f"{k}_initializer", "glorot_uniform")
        a.nothing(f"{k}_regularizer", f"{k}_constraint")
    a.initializer("bias_initializer", "zeros")
    a.nothing(*_CONSTRAINTS)
    a.done(
        "filters, kernel_size, strides, padding, dilation_rate, depth_multiplier, "
        "activation, use_bias, initializers"
    )
    return args


def _spatial(shape: Shape, pool, strides, padding, dilation=None) -> tuple[int, ...]:
    rank = len(pool)
    if len(shape) != rank + 1:
        raise ValueError(f"needs an input of {rank} spatial axes and channels, got {shape}")
    out = tuple(
        pad_1d(n, k, s, d, padding)[0]
        for n, k, s, d in zip(shape, pool, strides, dilation or [1] * rank, strict=False)
    )
    if min(out) < 1:
        raise ValueError(f"input {shape} is smaller than the {pool} window")
    return out


def _conv_infer(args: dict, shapes: list[Shape]) -> Shape:
    a = args
    hw = _spatial(shapes[0], a["kernel_size"], a["strides"], a["padding"], a["dilation_rate"])
    c = a["filters"] if "filters" in a else shapes[0][-1] * a["depth_multiplier"]
    if "depth_multiplier" not in a:
        check_groups(a, shapes[0])
    return (*hw, c)


def _conv_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    k, c = tuple(args["kernel_size"]), shapes[0][-1]
    if "depth_multiplier" not in args:
        w = [Weight("kernel", (*k, c // args.get("groups", 1), args["filters"]))]
        out = args["filters"]
    elif "filters" not in args:
        w = [Weight("kernel", (*k, c, args["depth_multiplier"]))]
        out = c * args["depth_multiplier"]
    else:
        m, out = args["depth_multiplier"], args["filters"]
        ones = (1,) * len(k)
        w = [
            Weight("depthwise_kernel", (*k, c, m)),
            Weight("pointwise_kernel", (*ones, c * m, out)),
        ]
    return w + ([Weight("bias", (out,))] if args["use_bias"] else [])


def _conv_build(spec, shapes, ctx):
    a = spec.args
    act = "linear" if ctx.fold and a["activation"] == ctx.fold else a["activation"]
    geo = (a["kernel_size"], a["strides"], a["padding"], a["dilation_rate"])
    if a.get("groups", 1) > 1:
        return depthwise_or_grouped(shapes[0], a["filters"], *geo, act, a["use_bias"], a["groups"])
    if "depth_multiplier" not in a:
        return Conv(shapes[0], a["filters"], *geo, act, a["use_bias"])
    if "filters" not in a:
        return Depthwise(shapes[0], *geo, a["depth_multiplier"], act, a["use_bias"])
    return Separable(shapes[0], a["filters"], *geo, a["depth_multiplier"], act, a["use_bias"])


def _pads(spec, kernel, strides, dilation=None) -> list[int]:
    """ONNX ``pads``: every axis' start, then every axis' end."""
    shape, rank = spec.in_shapes[0], len(kernel)
    geo = [
        pad_1d(n, k, s, d, spec.args["padding"])
        for n, k, s, d in zip(shape, kernel, strides, dilation or [1] * rank, strict=False)
    ]
    return [g[1] for g in geo] + [g[2] for g in geo]


def _conv_onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    x = onnx_acts.channels_first(g, spec)
    geo = {
        "strides": a["strides"],
        "dilations": a["dilation_rate"],
        "pads": _pads(spec, a["kernel_size"], a["strides"], a["dilation_rate"]),
    }
    rank = len(a["kernel_size"])
    to_oihw = (rank + 1, rank, *range(rank))  # (*k, in, out) → (out, in, *k)
    bias = [g.const(f"{n}_bias", weights[-1])] if a["use_bias"] else []
    c = spec.in_shapes[0][-1]
    if "depth_multiplier" not in a:
        k = g.const(f"{n}_kernel", weights[0].transpose(to_oihw))
        group = a.get("groups", 1)
        y = g.op("Conv", [x, k, *bias], n, kernel_shape=a["kernel_size"], group=group, **geo)
    else:
        m = a["depth_multiplier"]
        dw = weights[0].transpose(rank, rank + 1, *range(rank)).reshape(c * m, 1, *a["kernel_size"])
        sep = "filters" in a
        y = g.op(
            "Conv",
            [x, g.const(f"{n}_dw", dw), *([] if sep else bias)],
            f"{n}_dw",
            kernel_shape=a["kernel_size"],
            group=c,
            **geo,
        )
        if sep:
            pw = g.const(f"{n}_pw", weights[1].transpose(to_oihw))
            y = g.op("Conv", [y, pw, *bias], n, kernel_shape=[1] * rank)
    g.out(onnx_acts.act(g, onnx_acts.channels_last(g, spec, y), a["activation"]))


def _pool_parse(a: Args) -> dict:
    rank = int(a.cls[-2])
    pool = _ints(a, "pool_size", rank, 2)
    strides = pool if a.cfg.get("strides") is None else _ints(a, "strides", rank, None)
    a.take("strides")
    args = {
        "pool_size": pool,
        "strides": strides,
        "padding": a.must_be("padding", "valid", "same"),
        "data_format": a.channels_last(),
    }
    a.done("pool_size, strides, padding")
    return args


def _pool_infer(args: dict, shapes: list[Shape]) -> Shape:
    return (
        *_spatial(shapes[0], args["pool_size"], args["strides"], args["padding"]),
        shapes[0][-1],
    )


def _pool_build(spec, shapes, ctx):
    a = spec.args
    kind = "max" if spec.cls.startswith("Max") else "avg"
    return Pool(shapes[0], kind, a["pool_size"], a["strides"], a["padding"])


def _pool_onnx(g, spec, weights) -> None:
    a = spec.args
    x = onnx_acts.channels_first(g, spec)
    op = "MaxPool" if spec.cls.startswith("Max") else "AveragePool"
    extra = {} if op == "MaxPool" else {"count_include_pad": 0}
    y = g.op(
        op,
        [x],
        spec.name,
        kernel_shape=a["pool_size"],
        strides=a["strides"],
        pads=_pads(spec, a["pool_size"], a["strides"]),
        **extra,
    )
    g.out(onnx_acts.channels_last(g, spec, y))


def _global_parse(a: Args) -> dict:
    fmt = a.must_be("data_format", "channels_last", "channels_first", None) or "channels_last"
    args = {"data_format": fmt, "keepdims": bool(a.must_be("keepdims", False, True))}
    a.done("data_format, keepdims")
    return args


def _first(args: dict) -> bool:
    return args["data_format"] == "channels_first"


def _global_build(spec, shapes, ctx):
    kind = "max" if spec.cls.startswith("GlobalMax") else "avg"
    first = _first(spec.args)
    if first and ctx.mask:
        raise ValueError("data_format='channels_first' on a masked sequence is not supported")
    return GlobalPool(shapes[0], kind, spec.args["keepdims"], bool(ctx.mask), first)


def _global_onnx(g, spec, weights) -> None:
    op = "ReduceMax" if spec.cls.startswith("GlobalMax") else "ReduceMean"
    rank = len(spec.in_shapes[0])
    axes = list(range(2, rank + 1)) if _first(spec.args) else list(range(1, rank))
    y = g.op(op, [g.x(0, nchw=False)], spec.name, axes=axes, keepdims=int(spec.args["keepdims"]))
    g.out(y)


def _global(rank: int):
    def infer(args: dict, shapes: list[Shape]) -> Shape:
        if len(shapes[0]) != rank + 1:
            raise ValueError(f"needs an input of {rank} spatial axes and channels, got {shapes[0]}")
        if _first(args):
            c = shapes[0][0]
            return (c, *(1,) * rank) if args["keepdims"] else (c,)
        c = shapes[0][-1]
        return (*(1,) * rank, c) if args["keepdims"] else (c,)

    return infer


_CONV_DOC = (
    "`kernel_size`, `strides`, `padding` ({}), `dilation_rate`, `groups`, "
    + ACTS
    + ", `use_bias`, any initializer; channels last"
)
_MULT = "`depth_multiplier`, "
_POOL_DOC = "`pool_size`, `strides`, `padding` (valid, same; average counts real inputs only)"


def _depthwise_arg(args: dict, weight: str) -> tuple[dict, str]:
    """A DepthwiseConv's weight is Keras' ``kernel``, set by ``depthwise_*`` arguments."""
    return args, "depthwise_kernel" if weight == "kernel" else weight


def _conv(doc: str, **kw) -> Entry:
    return Entry(
        _conv_parse,
        _conv_build,
        _conv_onnx,
        infer=_conv_infer,
        weights=_conv_weights,
        doc=doc,
        **kw,
    )


ENTRIES = {
    "Conv1D": _conv("`filters`, " + _CONV_DOC.format("valid, same, causal")),
    "Conv3D": _conv(
        "`filters`, " + _CONV_DOC.format("valid, same").replace("`groups`", "`groups` (1)")
    ),
    "DepthwiseConv1D": _conv(_MULT + _CONV_DOC.format("valid, same"), weight_args=_depthwise_arg),
    "DepthwiseConv2D": _conv(_MULT + _CONV_DOC.format("valid, same"), weight_args=_depthwise_arg),
    "SeparableConv1D": _conv("`filters`, " + _MULT + _CONV_DOC.format("valid, same")),
    "SeparableConv2D": _conv("`filters`, " + _MULT + _CONV_DOC.format("valid, same")),
    **{
        cls: Entry(_pool_parse, _pool_build, _pool_onnx, infer=_pool_infer, doc=_POOL_DOC)
        for cls in ("MaxPooling1D", "AveragePooling1D", "MaxPooling3D", "AveragePooling3D")
    },
    **{
        cls: Entry(
            _global_parse,
            _global_build,
            _global_onnx,
            infer=_global(int(cls[-2])),
            doc="`keepdims`, `data_format` (channels_last; channels_first pools the last axes)",
        )
        for cls in (
            "GlobalMaxPooling1D",
            "GlobalAveragePooling1D",
            "GlobalMaxPooling2D",
            "GlobalMaxPooling3D",
            "GlobalAveragePooling3D",
        )
    },
}
