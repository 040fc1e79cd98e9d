"""Registry entries of the normalizations beside LayerNormalization: ``UnitNormalization``
(``engine/ops/unitnorm.py``) and ``GroupNormalization`` (``engine/ops/groupnorm.py``). Both
normalize per example (no batch statistics, nothing kept between steps); only the last axis
(channels last) is supported, any other axis is refused by name."""

from __future__ import annotations

from ringtrain_trainer.keras.entry import Args, Entry, Shape


def _last_axis(a: Args) -> int:
    axis = a.take("axis", -1)
    axis = axis[0] if isinstance(axis, list | tuple) and len(axis) == 1 else axis
    if not isinstance(axis, int) or isinstance(axis, bool) or axis == 0:
        a.refuse("axis", axis, "the last axis (-1)")
    return axis


def _check_last(args: dict, shapes: list[Shape]) -> Shape:
    if args["axis"] not in (-1, len(shapes[0])):
        raise ValueError(f"axis={args['axis']} is not the last axis of {shapes[0]} (supported: -1)")
    return shapes[0]


# -- UnitNormalization -------------------------------------------------------------------------
def _unit_parse(a: Args) -> dict:
    args = {"axis": _last_axis(a)}
    a.done("axis=-1")
    return args


def _unit_build(spec, shapes, ctx):
    from ringtrain_trainer.engine.ops.unitnorm import UnitNorm

    return UnitNorm(shapes[0])


def _unit_onnx(g, spec, weights) -> None:
    import numpy as np

    from ringtrain_trainer.engine.ops.unitnorm import EPSILON

    n, x = spec.name, g.x(0, nchw=False)
    ss = g.op("ReduceSumSquare", [x], f"{n}_ss", axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [ss], f"{n}_norm")], f"{n}_inv")
    inv = g.op("Min", [inv, g.const(f"{n}_clip", np.float32(1.0 / EPSILON))], f"{n}_clipped")
    g.out(g.op("Mul", [x, inv], n))


ENTRIES = {
    "UnitNormalization": Entry(
        _unit_parse,
        _unit_build,
        _unit_onnx,
        infer=_check_last,
        doc="the last axis: `x / max(‖x‖₂, 1e-12)` as Keras 3",
    ),
}
