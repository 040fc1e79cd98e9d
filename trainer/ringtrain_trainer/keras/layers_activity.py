"""Registry entry of Keras' ``ActivityRegularization(l1, l2)``: the engine's
``ops.activity.ActivityPenalty`` (its term joins the loss and its gradient the backward), the
identity in predict and in the ONNX export."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.activity import ActivityPenalty
from ringtrain_trainer.keras.entry import Args, Entry


def _parse(a: Args) -> dict:
    args = {}
    for k in ("l1", "l2"):
        v = a.take(k, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            a.refuse(k, v, "a number ≥ 0")
        args[k] = float(v)
    a.done("l1, l2")
    return args


def _build(spec, shapes, ctx):
    return ActivityPenalty(tuple(shapes[0]), spec.args["l1"], spec.args["l2"])


def _identity_onnx(g, spec, weights) -> None:
    g.out(g.x(0))


ENTRIES = {
    "ActivityRegularization": Entry(
        _parse,
        _build,
        _identity_onnx,
        doc="`l1`, `l2`: `(l1·Σ|x| + l2·Σx²) / batch` joins the loss, as Keras 3 adds it",
    ),
}
