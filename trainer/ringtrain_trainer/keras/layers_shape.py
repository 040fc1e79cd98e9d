"""Registry entries of the layers that move values without arithmetic, 1-D, 2-D and 3-D:
ZeroPadding, Cropping and UpSampling (nearest) (ops: ``engine/ops/shape.py``; ONNX ``Pad``,
``Slice`` and ``Resize`` on the channels-last tensor, no transpose needed; CenterCrop of a
larger input is a crop and shares the op), Permute and
RepeatVector (ops: ``engine/ops/rearrange.py``; ONNX ``Transpose``, ``Unsqueeze`` + ``Tile``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.rearrange import Permute, RepeatVector
from ringtrain_trainer.engine.ops.resize import Resize
from ringtrain_trainer.engine.ops.shape import Border, UpSampling
from ringtrain_trainer.keras.entry import Args, Entry, Shape
from ringtrain_trainer.keras.layers_resize import ENTRIES as RESIZE


def _sides(a: Args, arg: str, rank: int) -> list[list[int]]:
    """Keras' int / pair / pair of pairs → [[before, after]] per spatial axis."""
    v = a.take(arg, 1 if arg == "padding" else 0)
    try:
        if isinstance(v, int):
            out = [[v, v]] * rank
        elif rank == 1 and all(isinstance(i, int) for i in v):
            out = [list(v)]
        elif all(isinstance(i, int) for i in v):
            out = [[i, i] for i in v]
        else:
            out = [list(p) for p in v]
        ok = len(out) == rank and all(len(p) == 2 and min(p) >= 0 for p in out)
    except TypeError:
        ok = False
    if not ok:
        a.refuse(arg, v, f"an int, a pair or {rank} (before, after) pairs")
    return out


def _border_parse(a: Args) -> dict:
    rank, arg = int(a.cls[-2]), "padding" if a.cls.startswith("Zero") else "cropping"
    sides = _sides(a, arg, rank)
    args: dict = {arg: sides[0] if rank == 1 else sides}  # Keras' own forms
    if rank >= 2 or arg == "padding":
        args["data_format"] = a.channels_last()
    a.done(arg)
    return args


def _of(args: dict) -> list[list[int]]:
    """[[before, after]] per spatial axis, from either form."""
    v = args["padding"] if "padding" in args else args["cropping"]
    return [v] if isinstance(v[0], int) else v


def _border_infer(args: dict, shapes: list[Shape]) -> Shape:
    sides = _of(args)
    sign = 1 if "padding" in args else -1
    shape = shapes[0]
    if len(shape) != len(sides) + 1:
        raise ValueError(f"needs an input of {len(sides)} spatial axes and channels, got {shape}")
    out = tuple(n + sign * (p + q) for n, (p, q) in zip(shape, sides, strict=False))
    if min(out) < 1:
        raise ValueError(f"cropping {sides} leaves nothing of input {shape}")
    return (*out, shape[-1])


def _border_build(spec, shapes, ctx):
    pad = "padding" in spec.args
    return Border(shapes[0], tuple(map(tuple, _of(spec.args))), "pad" if pad else "crop")


def _i64(g, v) -> str:
    return g.const("i", np.asarray(v, np.int64))


def _border_onnx(g, spec, weights) -> None:
    x = g.x(0, nchw=False)
    if "padding" in spec.args:
        sides = _of(spec.args)
        pads = [0, *(p for p, _ in sides), 0, 0, *(q for _, q in sides), 0]
        g.out(g.op("Pad", [x, _i64(g, pads)], spec.name))
        return
    sides, shape = _of(spec.args), spec.in_shapes[0]
    starts = [p for p, _ in sides]
    ends = [n - q for n, (_, q) in zip(shape, sides, strict=False)]
    axes = list(range(1, len(sides) + 1))
    g.out(g.op("Slice", [x, _i64(g, starts), _i64(g, ends), _i64(g, axes)], spec.name))


def _up_parse(a: Args) -> dict:
    rank = int(a.cls[-2])
    v = a.take("size", 2)
    size = [v] * rank if isinstance(v, int) else list(v) if isinstance(v, list | tuple) else v
    if (
        not isinstance(size, list)
        or len(size) != rank
        or not all(isinstance(i, int) and i >= 1 for i in size)
    ):
        a.refuse("size", v, f"a positive int or {rank} of them")
    if rank == 1:
        a.done("size")
        return {"size": size[0]}
    args = {"size": size, "data_format": a.channels_last()}
    if rank == 2:  # UpSampling3D has no such argument
        args["interpolation"] = a.must_be("interpolation", "nearest", "bilinear")
    a.done("size, interpolation")
    return args


def _up_infer(args: dict, shapes: list[Shape]) -> Shape:
    size = args["size"] if isinstance(args["size"], list) else [args["size"]]
    shape = shapes[0]
    if len(shape) != len(size) + 1:
        raise ValueError(f"needs an input of {len(size)} spatial axes and channels, got {shape}")
    return (*(n * s for n, s in zip(shape, size, strict=False)), shape[-1])


def _as_resizing(spec):
    """``UpSampling2D(interpolation="bilinear")`` is Keras' ``ops.image.resize`` to the
    multiplied size: the ``Resizing`` layer's op and export, at that size."""
    (h, w, _), (sh, sw) = spec.in_shapes[0], spec.args["size"]
    args = {"height": h * sh, "width": w * sw, "interpolation": "bilinear"}
    return replace(spec, cls="Resizing", args=args)


def _up_build(spec, shapes, ctx):
    size = spec.args["size"]
    if spec.args.get("interpolation") == "bilinear":
        a = _as_resizing(spec).args
        return Resize(shapes[0], a["height"], a["width"], "bilinear")
    return UpSampling(shapes[0], tuple(size) if isinstance(size, list) else size)


def _up_onnx(g, spec, weights) -> None:
    if spec.args.get("interpolation") == "bilinear":
        RESIZE["Resizing"].onnx(g, _as_resizing(spec), weights)
        return

    size = spec.args["size"] if isinstance(spec.args["size"], list) else [spec.args["size"]]
    scales = g.const("scales", np.asarray([1, *size, 1], np.float32))
    y = g.op(
        "Resize",
        [g.x(0, nchw=False), "", scales],
        spec.name,
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )
    g.out(y)


def _center_parse(a: Args) -> dict:
    args: dict[str, Any] = {"height": a.positive("height"), "width": a.positive("width")}
    args["data_format"] = a.channels_last()
    a.done("height, width")
    return args


def _center_sides(args: dict, shape: Shape) -> list[list[int]]:
    """Keras' CenterCrop offsets (``(H - height) // 2`` first); an input smaller than the crop
    is resized by Keras (``smart_resize``), which ringtrain refuses."""
    if len(shape) != 3:
        raise ValueError(f"needs an (H, W, C) input, got {shape}")
    sides = []
    for n, want, what in ((shape[0], args["height"], "height"), (shape[1], args["width"], "width")):
        if n < want:
            raise ValueError(
                f"{what}={want} is larger than the input's {n}: Keras would resize "
                "(smart_resize), which is not supported (supported: a crop of a larger input)"
            )
        sides.append([(n - want) // 2, n - want - (n - want) // 2])
    return sides


def _center_infer(args: dict, shapes: list[Shape]) -> Shape:
    _center_sides(args, shapes[0])
    return (args["height"], args["width"], shapes[0][-1])


def _center_build(spec, shapes, ctx):
    sides = _center_sides(spec.args, shapes[0])
    return Border(shapes[0], tuple(map(tuple, sides)), "crop")


def _center_onnx(g, spec, weights) -> None:
    sides, shape = _center_sides(spec.args, spec.in_shapes[0]), spec.in_shapes[0]
    starts = [p for p, _ in sides]
    ends = [n - q for n, (_, q) in zip(shape, sides, strict=False)]
    x = g.x(0, nchw=False)
    g.out(g.op("Slice", [x, _i64(g, starts), _i64(g, ends), _i64(g, [1, 2])], spec.name))


def _permute_parse(a: Args) -> dict:
    dims = a.take("dims", None)
    if not isinstance(dims, list | tuple) or not all(isinstance(d, int) for d in dims):
        a.refuse("dims", dims, "a permutation of the axes 1..rank")
    a.done("dims")
    return {"dims": list(dims)}


def _permute_infer(args: dict, shapes: list[Shape]) -> Shape:
    dims, shape = args["dims"], shapes[0]
    if sorted(dims) != list(range(1, len(shape) + 1)):
        raise ValueError(f"dims={dims} is no permutation of axes 1..{len(shape)} of {shape}")
    return tuple(shape[d - 1] for d in dims)


def _permute_build(spec, shapes, ctx):
    return Permute(shapes[0], spec.args["dims"])


def _permute_onnx(g, spec, weights) -> None:
    g.out(g.op("Transpose", [g.x(0, nchw=False)], spec.name, perm=[0, *spec.args["dims"]]))


def _repeat_parse(a: Args) -> dict:
    n = a.take("n", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        a.refuse("n", n, "a positive int")
    a.done("n")
    return {"n": n}


def _repeat_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) != 1:
        raise ValueError(f"needs a flat input (features,), got {shapes[0]}")
    return (args["n"], shapes[0][0])


def _repeat_build(spec, shapes, ctx):
    return RepeatVector(shapes[0], spec.args["n"])


def _repeat_onnx(g, spec, weights) -> None:
    y = g.op("Unsqueeze", [g.x(0, nchw=False), _i64(g, [1])], f"{spec.name}_unsq")
    g.out(g.op("Tile", [y, _i64(g, [1, spec.args["n"], 1])], spec.name))


_BORDER = Entry(_border_parse, _border_build, _border_onnx, infer=_border_infer)
ENTRIES = {
    "ZeroPadding1D": replace(_BORDER, doc="`padding` (an int or a pair)"),
    "ZeroPadding2D": replace(_BORDER, doc="`padding` (int, pair, pairs)"),
    "Cropping1D": replace(_BORDER, doc="`cropping` (an int or a pair)"),
    "Cropping2D": replace(_BORDER, doc="`cropping` (int, pair, pairs)"),
    "UpSampling1D": Entry(_up_parse, _up_build, _up_onnx, infer=_up_infer, doc="`size`"),
    "UpSampling2D": Entry(
        _up_parse,
        _up_build,
        _up_onnx,
        infer=_up_infer,
        doc="`size`, `interpolation` (nearest; bilinear as Keras' `ops.image.resize`, the "
        "`Resizing` op)",
    ),
    "ZeroPadding3D": replace(_BORDER, doc="`padding` (int, triple, pairs)"),
    "Cropping3D": replace(_BORDER, doc="`cropping` (int, triple, pairs)"),
    "UpSampling3D": Entry(_up_parse, _up_build, _up_onnx, infer=_up_infer, doc="`size`"),
    "CenterCrop": Entry(
        _center_parse,
        _center_build,
        _center_onnx,
        infer=_center_infer,
        doc="`height`, `width` (an input at least that large: Keras resizes a smaller one)",
    ),
    "Permute": Entry(
        _permute_parse, _permute_build, _permute_onnx, infer=_permute_infer, doc="`dims`"
    ),
    "RepeatVector": Entry(
        _repeat_parse, _repeat_build, _repeat_onnx, infer=_repeat_infer, doc="`n`"
    ),
}
