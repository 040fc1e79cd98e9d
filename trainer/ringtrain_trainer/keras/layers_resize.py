"""Registry entry of Keras ``Resizing`` (op: ``engine/ops/resize.py``): deterministic, active
in ``predict`` too, so unlike the augmentation layers it is an ordinary op anywhere in the
graph. Bilinear (half-pixel centres, no antialiasing) and nearest, as Keras 3 defaults;
``crop_to_aspect_ratio``, ``pad_to_aspect_ratio``, ``antialias`` and the other interpolations
are refused by name. ONNX: ``Resize`` with ``half_pixel`` coordinates (nearest rounding half
up, which is TensorFlow's ``floor((o + 0.5) * scale)``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.resize import INTERPOLATIONS, Resize
from ringtrain_trainer.keras.entry import Args, Entry, Shape


def _parse(a: Args) -> dict:
    args: dict[str, Any] = {"height": a.positive("height"), "width": a.positive("width")}
    args["interpolation"] = a.must_be("interpolation", *INTERPOLATIONS)
    a.must_be("crop_to_aspect_ratio", False)
    a.must_be("pad_to_aspect_ratio", False)
    a.must_be("antialias", False)
    # only read by Keras with pad_to_aspect_ratio (refused above): kept for the export
    args["fill_mode"] = a.take("fill_mode", "constant")
    args["fill_value"] = a.take("fill_value", 0.0)
    args["data_format"] = a.channels_last()
    # Keras records ``training=True`` on a preprocessing layer's Functional node; Resizing
    # computes the same in both modes, so the call argument changes nothing
    a.must_be("training", None, True, False)
    a.done("height, width, interpolation (bilinear, nearest)")
    return args


def _infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) != 3:
        raise ValueError(f"needs an (H, W, C) input, got {shapes[0]}")
    return (args["height"], args["width"], shapes[0][-1])


def _build(spec, shapes, ctx):
    a = spec.args
    return Resize(shapes[0], a["height"], a["width"], a["interpolation"])


def _onnx(g, spec, weights) -> None:
    a, n = spec.args, spec.name
    x = g.x(0, nchw=True)
    shape = g.op("Shape", [x], f"{n}_shape")
    bc = g.op(
        "Slice",
        [
            shape,
            g.const(f"{n}_0", np.asarray([0], np.int64)),
            g.const(f"{n}_2", np.asarray([2], np.int64)),
        ],
        f"{n}_bc",
    )
    hw = g.const(f"{n}_hw", np.asarray([a["height"], a["width"]], np.int64))
    sizes = g.op("Concat", [bc, hw], f"{n}_sizes", axis=0)
    modes = {
        "bilinear": {"mode": "linear"},
        "nearest": {"mode": "nearest", "nearest_mode": "round_prefer_ceil"},
    }
    y = g.op(
        "Resize",
        [x, "", "", sizes],
        n,
        coordinate_transformation_mode="half_pixel",
        **modes[a["interpolation"]],
    )
    g.out(y)


ENTRIES = {
    "Resizing": Entry(
        _parse,
        _build,
        _onnx,
        infer=_infer,
        call_args=("training",),
        doc="`height`, `width`, `interpolation` (bilinear, nearest; no antialias, no crop/pad "
        "to aspect ratio), active in predict and anywhere in the graph",
    ),
}
