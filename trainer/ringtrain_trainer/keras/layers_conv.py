"""Registry entries of the 2-D window layers: Conv2D, Max/AveragePooling2D,
GlobalAveragePooling2D (channels last, NHWC). A Conv2D with a dilation or an activation beyond
``entry.ACTIVATIONS`` runs on ``engine.ops.conv.Conv`` (``layers_window``'s op)."""

from __future__ import annotations

from typing import Any

from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.pool import GlobalPool, Pool
from ringtrain_trainer.engine.ops.window import same_pad
from ringtrain_trainer.keras import layers_window, onnx_acts
from ringtrain_trainer.keras.entry import (
    ACTIVATIONS,
    Args,
    Entry,
    Shape,
    Weight,
    need_rank,
    window,
)
from ringtrain_trainer.keras.layers_window import ACTS, _activation, check_groups, groups

_FREE = (
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "lora_rank",
    "lora_alpha",
)


def _padding(a: Args) -> str:
    v = a.take("padding", "valid")
    if v not in ("valid", "same"):
        a.refuse("padding", v, "'valid' or 'same'")
    return v


def _windowed(shape: Shape, kernel, strides, padding) -> tuple[int, int]:
    if len(shape) != 3:
        raise ValueError(f"needs an input of (height, width, channels), got {shape}")
    ho, wo = (window(n, k, s, padding) for n, k, s in zip(shape[:2], kernel, strides, strict=True))
    if ho < 1 or wo < 1:
        raise ValueError(f"input {shape} is smaller than the {kernel[0]}x{kernel[1]} window")
    return ho, wo


def _conv_parse(a: Args) -> dict:
    a.trainable()
    args: dict[str, Any] = {
        "filters": a.positive("filters"),
        "kernel_size": a.pair("kernel_size", None),
        "strides": a.pair("strides", 1),
        "padding": _padding(a),
        "data_format": a.channels_last(),
        "dilation_rate": a.pair("dilation_rate", 1),
        "activation": _activation(a),
        "use_bias": bool(a.take("use_bias", True)),
    }
    if max(args["strides"]) > 1 and max(args["dilation_rate"]) > 1:
        a.refuse("dilation_rate", args["dilation_rate"], "1 when strides > 1 (as Keras)")
    groups(a, args)
    a.initializer("kernel_initializer", "glorot_uniform")
    a.initializer("bias_initializer", "zeros")
    a.nothing(*_FREE)
    a.done("filters, kernel_size, strides, padding, dilation_rate, groups, activation, use_bias")
    return args


def _span(args: dict) -> list[int]:
    """The dilated kernel's extent per axis."""
    d = args.get("dilation_rate", [1, 1])
    return [(k - 1) * r + 1 for k, r in zip(args["kernel_size"], d, strict=True)]


def _conv_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) == 3:
        check_groups(args, shapes[0])
    return (*_windowed(shapes[0], _span(args), args["strides"], args["padding"]), args["filters"])


def _conv_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    kh, kw = args["kernel_size"]
    f = args["filters"]
    w = [Weight("kernel", (kh, kw, shapes[0][-1] // args.get("groups", 1), f))]
    return w + ([Weight("bias", (f,))] if args["use_bias"] else [])


def _conv_build(spec, shapes, ctx):
    a = spec.args
    need_rank(spec, shapes[0], 3, "an H×W×C input (add a Reshape before it)")
    if a.get("groups", 1) > 1:
        return layers_window._conv_build(spec, shapes, ctx)
    if a.get("dilation_rate", [1, 1]) != [1, 1] or a["activation"] not in ACTIVATIONS:
        geo = (a["kernel_size"], a["strides"], a["padding"], a["dilation_rate"])
        return Conv(shapes[0], a["filters"], *geo, a["activation"], a["use_bias"])
    return Conv(
        tuple(shapes[0]),
        a["filters"],
        tuple(a["kernel_size"]),
        tuple(a["strides"]),
        a["padding"],
        1,
        a["activation"],
        a["use_bias"],
    )


def _pads(spec, kernel, strides) -> list[int]:
    if spec.args["padding"] != "same":
        return [0, 0, 0, 0]
    (_, t, b), (_, l_, r) = (
        same_pad(n, k, s) for n, k, s in zip(spec.in_shapes[0][:2], kernel, strides, strict=True)
    )
    return [t, l_, b, r]


def _conv_onnx(g, spec, weights) -> None:
    a = spec.args
    if a.get("groups", 1) > 1:
        layers_window._conv_onnx(g, spec, weights)
        return
    x = g.x(0, nchw=True)
    inputs = [x, g.const(f"{spec.name}_kernel", weights[0].transpose(3, 2, 0, 1))]
    if a["use_bias"]:
        inputs.append(g.const(f"{spec.name}_bias", weights[1]))
    y = g.op(
        "Conv",
        inputs,
        spec.name,
        kernel_shape=a["kernel_size"],
        strides=a["strides"],
        dilations=a.get("dilation_rate", [1, 1]),
        pads=_pads(spec, _span(a), a["strides"]),
    )
    g.out(onnx_acts.act(g, y, a["activation"]))


def _pool_parse(a: Args) -> dict:
    pool = a.pair("pool_size", 2)
    # checked like pool_size: a stride of 0 divided by zero at every reconcile (issue 20)
    strides = pool if a.cfg.get("strides") is None else a.pair("strides", None)
    a.take("strides")
    args = {
        "pool_size": pool,
        "strides": strides,
        "padding": _padding(a),
        "data_format": a.channels_last(),
    }
    a.done("pool_size, strides, padding")
    return args


def _pool_infer(args: dict, shapes: list[Shape]) -> Shape:
    return (
        *_windowed(shapes[0], args["pool_size"], args["strides"], args["padding"]),
        shapes[0][-1],
    )


def _pool_build(spec, shapes, ctx):
    a = spec.args
    need_rank(spec, shapes[0], 3, "an H×W×C input")
    kind = "max" if spec.cls == "MaxPooling2D" else "avg"
    return Pool(tuple(shapes[0]), kind, tuple(a["pool_size"]), tuple(a["strides"]), a["padding"])


def _pool_onnx(g, spec, weights) -> None:
    a = spec.args
    x = g.x(0, nchw=True)
    op = "MaxPool" if spec.cls == "MaxPooling2D" else "AveragePool"
    extra = {} if op == "MaxPool" else {"count_include_pad": 0}
    pads = _pads(spec, a["pool_size"], a["strides"])
    g.out(
        g.op(
            op,
            [x],
            spec.name,
            kernel_shape=a["pool_size"],
            strides=a["strides"],
            pads=pads,
            **extra,
        )
    )


def _gap_parse(a: Args) -> dict:
    args = {"data_format": a.channels_last(), "keepdims": bool(a.must_be("keepdims", False, True))}
    a.done("keepdims")
    return args


def _gap_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) != 3:
        raise ValueError(f"needs an input of (height, width, channels), got {shapes[0]}")
    c = shapes[0][-1]
    return (1, 1, c) if args["keepdims"] else (c,)


def _gap_build(spec, shapes, ctx):
    need_rank(spec, shapes[0], 3, "an H×W×C input")
    if spec.args["keepdims"]:  # squeeze-excitation blocks keep (1, 1, C) for a Multiply
        return GlobalPool(shapes[0], "avg", True)
    return GlobalPool(tuple(shapes[0]), "avg")


def _gap_onnx(g, spec, weights) -> None:
    y = g.op("GlobalAveragePool", [g.x(0, nchw=True)], spec.name)
    if not spec.args["keepdims"]:
        g.nchw = False
        y = g.op("Flatten", [y], f"{spec.name}_squeeze", axis=1)
    g.out(y)


ENTRIES = {
    "Conv2D": Entry(
        _conv_parse,
        _conv_build,
        _conv_onnx,
        infer=_conv_infer,
        weights=_conv_weights,
        doc="`filters`, `kernel_size`, `strides`, `padding` (valid, same), `dilation_rate`, "
        "`groups` (one group per channel, ConvNeXt's: run as a depthwise convolution), "
        + ACTS
        + ", `use_bias`; channels last; with its only reader a "
        "MaxPooling2D(2) (square kernel, valid, stride 1, ReLU) it runs as one fused op",
    ),
    "MaxPooling2D": Entry(
        _pool_parse,
        _pool_build,
        _pool_onnx,
        infer=_pool_infer,
        doc="`pool_size`, `strides`, `padding` (valid, same)",
    ),
    "AveragePooling2D": Entry(
        _pool_parse,
        _pool_build,
        _pool_onnx,
        infer=_pool_infer,
        doc="`pool_size`, `strides`, `padding` (valid, same; padding not counted)",
    ),
    "GlobalAveragePooling2D": Entry(
        _gap_parse,
        _gap_build,
        _gap_onnx,
        infer=_gap_infer,
        doc="`keepdims`",
    ),
}
