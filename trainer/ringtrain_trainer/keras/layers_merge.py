"""Registry entries of the merge layers (several inputs, one output): Add, Subtract, Multiply,
Average, Maximum, Minimum, Concatenate. Their ops are ``engine/ops/merge.py``."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.broadcast import Broadcast, broadcast_shape
from ringtrain_trainer.engine.ops.merge import Concatenate, Merge
from ringtrain_trainer.keras.entry import Args, Entry, Shape

#: Keras class → (engine mode, ONNX op: variadic except Sub and Mul, chained)
_MODES = {
    "Add": ("add", "Sum"),
    "Subtract": ("subtract", "Sub"),
    "Multiply": ("multiply", "Mul"),
    "Average": ("average", "Mean"),
    "Maximum": ("maximum", "Max"),
    "Minimum": ("minimum", "Min"),
}


def _merge_parse(a: Args) -> dict:
    a.done("none")
    return {}


#: the merges whose two inputs may broadcast (``engine/ops/broadcast.py``), as Keras 3's do
BROADCAST = ("Add", "Subtract", "Multiply")


def _merge_infer(cls: str):
    def infer(args: dict, shapes: list[Shape]) -> Shape:
        if len(set(shapes)) == 1:
            return shapes[0]
        if cls in BROADCAST and len(shapes) == 2:
            try:
                return broadcast_shape(shapes)
            except ValueError:
                pass
        raise ValueError(
            f"inputs of shapes {', '.join(map(str, shapes))} are not supported "
            "(supported: inputs of one shape; two inputs of one rank that broadcast for "
            f"{', '.join(BROADCAST)})"
        )

    return infer


def _merge_build(spec, shapes, ctx):
    if spec.cls == "Subtract" and len(shapes) != 2:
        raise ValueError("Subtract takes exactly 2 inputs")
    if len(set(map(tuple, shapes))) > 1:
        return Broadcast(shapes, _MODES[spec.cls][0])
    return Merge(shapes[0], _MODES[spec.cls][0], len(shapes))


def _merge_onnx(g, spec, weights) -> None:
    op = _MODES[spec.cls][1]
    xs = g.xs()
    if op in ("Sub", "Mul"):
        y = xs[0]
        for k, x in enumerate(xs[1:]):
            y = g.op(op, [y, x], f"{spec.name}_{k}")
    else:
        y = g.op(op, xs, spec.name)
    g.out(y)


def _concat_parse(a: Args) -> dict:
    axis = a.take("axis", -1)
    if not isinstance(axis, int) or isinstance(axis, bool) or axis == 0:
        a.refuse("axis", axis, "a non-batch axis (an int other than 0)")
    a.done("axis")
    return {"axis": axis}


def _concat_axis(args: dict, rank: int) -> int:
    """The per-example axis (0-based, no batch axis)."""
    axis = args["axis"]
    return axis % (rank + 1) - 1 if axis > 0 else axis % rank


def _concat_infer(args: dict, shapes: list[Shape]) -> Shape:
    rank = len(shapes[0])
    if any(len(s) != rank for s in shapes) or not -rank <= args["axis"] <= rank:
        raise ValueError(f"axis={args['axis']} does not fit inputs of shapes {shapes}")
    axis = _concat_axis(args, rank)
    rest = {s[:axis] + s[axis + 1 :] for s in shapes}
    if len(rest) != 1:
        raise ValueError(f"inputs of shapes {shapes} differ off axis {args['axis']}")
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return tuple(out)


def _concat_build(spec, shapes, ctx):
    return Concatenate(shapes, _concat_axis(spec.args, len(shapes[0])))


def _concat_onnx(g, spec, weights) -> None:
    xs = [g.x(k, nchw=False) for k in range(len(spec.inputs))]
    axis = _concat_axis(spec.args, len(spec.in_shapes[0])) + 1
    g.out(g.op("Concat", xs, spec.name, axis=axis))


ENTRIES = {
    **{
        cls: Entry(
            _merge_parse,
            _merge_build,
            _merge_onnx,
            infer=_merge_infer(cls),
            inputs=0,
            doc=("2 or more inputs of one shape" if cls != "Subtract" else "2 inputs of one shape")
            + ("; or 2 of one rank that broadcast" if cls in BROADCAST else ""),
        )
        for cls in _MODES
    },
    "Concatenate": Entry(
        _concat_parse,
        _concat_build,
        _concat_onnx,
        infer=_concat_infer,
        inputs=0,
        doc="`axis`; inputs equal off the axis",
    ),
}
