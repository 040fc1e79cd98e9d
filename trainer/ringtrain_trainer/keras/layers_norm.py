"""Registry entries of the normalizations beside LayerNormalization: ``UnitNormalization``
(``engine/ops/unitnorm.py``) and ``GroupNormalization`` (``engine/ops/groupnorm.py``). Both
normalize per example (no batch statistics, nothing kept between steps); only the last axis
(channels last) is supported, any other axis is refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.groupnorm import GroupNorm
from ringtrain_trainer.engine.ops.unitnorm import EPSILON, UnitNorm
from ringtrain_trainer.engine.ranges import NON_NEGATIVE
from ringtrain_trainer.keras.entry import Args, Entry, Shape, gamma_beta_weights
from ringtrain_trainer.keras.layers_sequence import no


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
    return UnitNorm(shapes[0])


def unit_nodes(g, x: str, n: str, epsilon: float) -> str:
    """ONNX nodes of ``x * min(rsqrt(sum(x²)), 1 / epsilon)`` over the last axis (also
    ``Dot(normalize=True)``'s)."""
    ss = g.op("ReduceSumSquare", [x], f"{n}_ss", axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [ss], f"{n}_norm")], f"{n}_inv")
    inv = g.op("Min", [inv, g.const(f"{n}_clip", np.float32(1.0 / epsilon))], f"{n}_clipped")
    return g.op("Mul", [x, inv], n)


def _unit_onnx(g, spec, weights) -> None:
    g.out(unit_nodes(g, g.x(0, nchw=False), spec.name, EPSILON))


ENTRIES = {
    "UnitNormalization": Entry(
        _unit_parse,
        _unit_build,
        _unit_onnx,
        infer=_check_last,
        doc="the last axis: `x / max(‖x‖₂, 1e-12)` as Keras 3",
    ),
}


# -- GroupNormalization ------------------------------------------------------------------------
def _group_parse(a: Args) -> dict:
    a.trainable()
    groups = a.take("groups", 32)
    if not isinstance(groups, int) or isinstance(groups, bool) or (groups < 1 and groups != -1):
        a.refuse("groups", groups, "a positive int or -1 (one group per channel)")
    args: dict[str, Any] = {"groups": groups, "axis": _last_axis(a)}
    eps = a.number("epsilon", 1e-3, NON_NEGATIVE)
    args.update(epsilon=eps, center=bool(a.take("center", True)))
    args["scale"] = bool(a.take("scale", True))
    a.initializer("beta_initializer", "Zeros")
    a.initializer("gamma_initializer", "Ones")
    no(a, "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint")
    a.done("groups, axis=-1, epsilon, center, scale")
    return args


def _groups(args: dict, shape: Shape) -> int:
    return shape[-1] if args["groups"] == -1 else args["groups"]


def _group_infer(args: dict, shapes: list[Shape]) -> Shape:
    c, g = shapes[0][-1], _groups(args, shapes[0])
    if c % g:
        raise ValueError(f"{c} channels do not split into groups={g}")
    return _check_last(args, shapes)


def _group_build(spec, shapes, ctx):
    a = spec.args
    g = _groups(a, tuple(shapes[0]))
    return GroupNorm(shapes[0], g, a["epsilon"], a["center"], a["scale"])


def _group_onnx(g, spec, weights) -> None:
    """Primitive nodes: opset 17 has no GroupNormalization (18's was withdrawn in 21)."""
    a, n, w = spec.args, spec.name, list(weights)
    c = spec.out_shape[-1]
    groups = _groups(a, tuple(spec.out_shape))
    x = g.x(0, nchw=False)
    grid = g.const(f"{n}_grid", np.array([0, -1, groups, c // groups], np.int64))
    x4 = g.op("Reshape", [x, grid], f"{n}_groups")
    mean = g.op("ReduceMean", [x4], f"{n}_mean", axes=[1, 3], keepdims=1)
    xc = g.op("Sub", [x4, mean], f"{n}_centered")
    var = g.op("ReduceMean", [g.op("Mul", [xc, xc], f"{n}_sq")], f"{n}_var", axes=[1, 3])
    eps = g.const(f"{n}_eps", np.float32(a["epsilon"]))
    std = g.op("Sqrt", [g.op("Add", [var, eps], f"{n}_ve")], f"{n}_std")
    xhat = g.op("Div", [xc, std], f"{n}_xhat")
    y = g.op("Reshape", [xhat, g.op("Shape", [x], f"{n}_shape")], f"{n}_back")
    if a["scale"]:
        y = g.op("Mul", [y, g.const(f"{n}_gamma", w.pop(0))], f"{n}_scaled")
    if a["center"]:
        y = g.op("Add", [y, g.const(f"{n}_beta", w.pop(0))], f"{n}_centered_out")
    g.out(y)


ENTRIES["GroupNormalization"] = Entry(
    _group_parse,
    _group_build,
    _group_onnx,
    infer=_group_infer,
    weights=gamma_beta_weights,
    doc="`groups` (or -1), `epsilon`, `center`, `scale`; the last (channels) axis; statistics "
    "per example over each group's channels and all positions",
)
