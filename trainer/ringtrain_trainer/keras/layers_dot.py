"""Registry entry of Keras' ``Dot(axes, normalize)``: two inputs, the per-example dot product
along one axis of each (``engine/ops/dot.py``). Supported: two vectors ``(d,)`` (a
recommender's user·item score, ``normalize=True``: cosine similarity) and two matrices
``(n, k)`` contracted on any axis of each (a batched matmul, attention-style scores;
``normalize=True`` on the last axes). Anything else is refused naming the shapes and axes."""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.dot import KERAS_EPSILON, Dot
from ringtrain_trainer.keras.entry import Args, Entry, Shape
from ringtrain_trainer.keras.layers_norm import unit_nodes


def _parse(a: Args) -> dict:
    axes = a.take("axes")
    pair = [axes, axes] if isinstance(axes, int) else axes
    ok = isinstance(pair, list | tuple) and len(pair) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        a.refuse("axes", axes, "an int or a pair of ints")
    if 0 in pair:
        a.refuse("axes", axes, "non-batch axes")
    args = {"axes": axes, "normalize": bool(a.take("normalize", False))}
    a.done("axes, normalize")
    return args


def example_axes(args: dict, shapes: list[Shape]) -> tuple[int, int]:
    """Each input's contracted axis, 0-based without the batch axis (Keras counts it)."""
    axes = args["axes"]
    pair = [axes, axes] if isinstance(axes, int) else list(axes)
    ax, ay = (v % (len(s) + 1) - 1 for v, s in zip(pair, shapes, strict=True))
    return ax, ay


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes) != 2:
        raise ValueError(f"Dot takes exactly 2 inputs, got {len(shapes)}")
    (sx, sy), (ax, ay) = shapes, example_axes(args, shapes)
    fits = len(sx) == len(sy) and len(sx) in (1, 2) and sx[ax] == sy[ay]
    last = len(sx) == 1 or (ax, ay) == (1, 1)
    if not fits or (args["normalize"] and not last):
        raise ValueError(
            f"inputs of shapes {sx}, {sy} with axes={args['axes']}, normalize="
            f"{args['normalize']} are not supported (supported: two (d,) vectors, or two "
            "(n, k) matrices of equal contracted size; normalize on the last axes)"
        )
    return (1,) if len(sx) == 1 else (sx[1 - ax], sy[1 - ay])


def _build(spec, shapes, ctx):
    return Dot(shapes, example_axes(spec.args, shapes), spec.args["normalize"])


def _onnx(g, spec, weights) -> None:
    n, shapes = spec.name, [tuple(s) for s in spec.in_shapes]
    x, y = (g.x(k, nchw=False) for k in range(2))
    if spec.args["normalize"]:
        x = unit_nodes(g, x, f"{n}_x_unit", KERAS_EPSILON)
        y = unit_nodes(g, y, f"{n}_y_unit", KERAS_EPSILON)
    if len(shapes[0]) == 1:
        axis = g.const(f"{n}_axis", np.array([1], np.int64))
        g.out(g.op("ReduceSum", [g.op("Mul", [x, y], f"{n}_prod"), axis], n, keepdims=1))
        return
    ax, ay = example_axes(spec.args, shapes)
    if ax == 0:
        x = g.op("Transpose", [x], f"{n}_xt", perm=[0, 2, 1])
    if ay == 1:
        y = g.op("Transpose", [y], f"{n}_yt", perm=[0, 2, 1])
    g.out(g.op("MatMul", [x, y], n))


ENTRIES = {
    "Dot": Entry(
        _parse,
        _build,
        _onnx,
        infer=_infer,
        inputs=0,
        doc="`axes`, `normalize` (cosine); two (d,) vectors → (1,), or two (n, k) matrices "
        "contracted on one axis each (a batched matmul); normalize on the last axes",
    ),
}
