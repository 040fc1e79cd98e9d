"""Registry entry of Keras' ``Identity``: a layer that returns its input (placeholders in
keras.io examples, a switchable block of an application). It builds to no op at all and
exports as Keras' ``Identity`` and as ONNX's ``Identity`` node, so nothing is silently dropped
from the exported graph either."""

from __future__ import annotations

from ringtrain_trainer.keras.entry import Args, Entry


def _parse(a: Args) -> dict:
    a.done("none")
    return {}


def _onnx(g, spec, weights) -> None:
    g.out(g.op("Identity", [g.x(0)], spec.name))


ENTRIES = {
    "Identity": Entry(
        _parse,
        lambda spec, shapes, ctx: None,
        _onnx,
        doc="no arguments; builds to nothing, exported as Keras' and ONNX's Identity",
    ),
}
