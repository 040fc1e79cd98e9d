"""Registry entries of ``Conv1DTranspose`` and ``Conv2DTranspose`` (op:
``engine/ops/convtranspose.py``; ONNX ``ConvTranspose`` with the op's own padding, so the
exported graph computes the same crop of the full transposed convolution)."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.convtranspose import ConvTranspose, output_length
from ringtrain_trainer.keras import onnx_acts
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight
from ringtrain_trainer.keras.layers_window import _CONSTRAINTS, ACTS, _activation, _ints


def _parse(a: Args) -> dict:
    rank = int(a.cls[4])  # Conv1DTranspose, Conv2DTranspose
    a.trainable()
    args: dict = {
        "filters": a.positive("filters"),
        "kernel_size": _ints(a, "kernel_size", rank, None),
        "strides": _ints(a, "strides", rank, 1),
        "padding": a.must_be("padding", "valid", "same"),
        "data_format": a.channels_last(),
    }
    out_pad = a.take("output_padding")
    if out_pad is not None:
        out_pad = [out_pad] * rank if isinstance(out_pad, int) else list(out_pad)
        ok = len(out_pad) == rank and all(
            isinstance(p, int) and 0 <= p < s
            for p, s in zip(out_pad, args["strides"], strict=False)
        )
        if not ok:
            a.refuse("output_padding", out_pad, "None or ints below the strides (as Keras)")
    args["output_padding"] = out_pad
    args["dilation_rate"] = _ints(a, "dilation_rate", rank, 1)
    if max(args["dilation_rate"]) > 1:
        a.refuse("dilation_rate", args["dilation_rate"], "1")
    args["activation"] = _activation(a)
    args["use_bias"] = bool(a.take("use_bias", True))
    a.initializer("kernel_initializer", "glorot_uniform")
    a.nothing("kernel_regularizer", "kernel_constraint")
    a.initializer("bias_initializer", "zeros")
    a.nothing(*_CONSTRAINTS)
    a.done("filters, kernel_size, strides, padding, output_padding, activation, use_bias")
    return args


def _op(args: dict, shape: Shape):
    geo = (args["kernel_size"], args["strides"], args["padding"], args["output_padding"])
    return ConvTranspose(shape, args["filters"], *geo, args["activation"], args["use_bias"])


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    shape, k = shapes[0], args["kernel_size"]
    if len(shape) != len(k) + 1:
        raise ValueError(f"needs an input of {len(k)} spatial axes and channels, got {shape}")
    pads = args["output_padding"] or [None] * len(k)
    geo = zip(shape, k, args["strides"], pads, strict=False)
    return (*(output_length(n, kk, s, args["padding"], p) for n, kk, s, p in geo), args["filters"])


def _weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    w = [Weight("kernel", (*args["kernel_size"], args["filters"], shapes[0][-1]))]
    return w + ([Weight("bias", (args["filters"],))] if args["use_bias"] else [])


def _build(spec, shapes, ctx):
    args = spec.args
    if ctx.fold and args["activation"] == ctx.fold:
        args = {**args, "activation": "linear"}
    return _op(args, shapes[0])


def _onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    op = _op(a, spec.in_shapes[0])
    rank = len(a["kernel_size"])
    begin, end, extra = [], [], []
    for size, k, s, place, out in zip(
        spec.in_shapes[0], op.k, op.s, op.place, op.out_shape, strict=False
    ):
        full, before = (size - 1) * s + k, k - 1 - place.start
        begin.append(before)
        end.append(max(full - before - out, 0))
        extra.append(max(before + out - full, 0))
    w = g.const(f"{n}_kernel", weights[0].transpose(rank + 1, rank, *range(rank)))
    bias = [g.const(f"{n}_bias", weights[1])] if a["use_bias"] else []
    y = g.op(
        "ConvTranspose",
        [onnx_acts.channels_first(g, spec), w, *bias],
        n,
        kernel_shape=a["kernel_size"],
        strides=a["strides"],
        pads=begin + end,
        output_padding=extra,
    )
    g.out(onnx_acts.act(g, onnx_acts.channels_last(g, spec, y), a["activation"]))


_DOC = (
    "`filters`, `kernel_size`, `strides`, `padding` (valid, same), `output_padding`, "
    + ACTS
    + ", `use_bias`, any initializer; channels last; `dilation_rate` 1"
)
ENTRIES = {
    "Conv1DTranspose": Entry(_parse, _build, _onnx, infer=_infer, weights=_weights, doc=_DOC),
    "Conv2DTranspose": Entry(_parse, _build, _onnx, infer=_infer, weights=_weights, doc=_DOC),
}
