"""Registry entry of keras.applications ConvNeXt's ``LayerScale`` (``x * gamma``, one trainable
value per channel; op: ``engine/ops/scale.py``). Keras deserializes it from its own module, so
the export names that module (``Entry.module``); fresh weights are Keras' ``Constant``
initializer of ``init_values``."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.scale import ChannelScale
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight


def _parse(a: Args) -> dict:
    a.trainable()
    v = a.take("init_values")
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        a.refuse("init_values", v, "a number")
    args = {"init_values": float(v), "projection_dim": a.positive("projection_dim")}
    a.done("init_values, projection_dim")
    return args


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if not shapes[0] or shapes[0][-1] != args["projection_dim"]:
        d = args["projection_dim"]
        raise ValueError(f"projection_dim={d} is not the last axis of {shapes[0]}")
    return shapes[0]


def _weight_args(args: dict, weight: str) -> tuple[dict, str]:
    """``gamma`` starts at ``init_values`` (not an argument Keras' config carries by name)."""
    init = {"class_name": "Constant", "config": {"value": args["init_values"]}}
    return {"gamma_initializer": init}, weight


def _build(spec, shapes, ctx):
    return ChannelScale(shapes[0])


def _onnx(g, spec, weights) -> None:
    g.out(g.op("Mul", [g.x(0), g.per_channel(f"{spec.name}_gamma", weights[0])], spec.name))


ENTRIES = {
    "LayerScale": Entry(
        _parse,
        _build,
        _onnx,
        infer=_infer,
        weights=lambda args, shapes: [Weight("gamma", (args["projection_dim"],))],
        weight_args=_weight_args,
        module="keras.src.applications.convnext",
        doc="keras.applications ConvNeXt's: `init_values`, `projection_dim` (a trainable "
        "`gamma` per channel)",
    ),
}
