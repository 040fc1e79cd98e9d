"""Registry entries of Keras' ``RandomBrightness`` and ``RandomContrast``
(``engine/ops/augment_pixel.py``): training only, with a backward; the identity in predict and
in the ONNX export, as the other augmentation layers (``layers_augment``)."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.augment_pixel import RandomPixel
from ringtrain_trainer.keras.entry import Args, Entry, need_rank

#: Keras 3's ``_FACTOR_BOUNDS`` per class: a number ``f`` is ``(max(-f, low), f)``
_BOUNDS = {"RandomBrightness": (-1.0, 1.0), "RandomContrast": (0.0, 1.0)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse(a: Args) -> dict:
    low, high = _BOUNDS[a.cls]
    f = a.take("factor")
    if _number(f) and low <= f <= high:
        factor = [max(-abs(float(f)), low), abs(float(f))]
    elif isinstance(f, (list, tuple)) and len(f) == 2 and all(map(_number, f)):
        factor = sorted(float(v) for v in f)
    else:
        a.refuse("factor", f, f"a number in [{low}, {high}] or (lower, upper)")
    vr = a.take("value_range", [0, 255])
    ok = isinstance(vr, (list, tuple)) and len(vr) == 2 and all(map(_number, vr))
    if not ok or (a.cls == "RandomContrast" and vr[0] > vr[1]):  # Keras clips to (vr[0], vr[1])
        a.refuse("value_range", vr, "(low, high), low ≤ high")
    a.take("seed")  # the draws come from --seed, the step and the example
    a.must_be("data_format", "channels_last", None)
    a.done("factor, value_range")
    return {"factor": factor, "value_range": sorted(float(v) for v in vr)}


def _build(spec, shapes, ctx):
    need_rank(spec, tuple(shapes[0]), 3, "(height, width, channels) images")
    f = spec.args["factor"]
    if spec.cls == "RandomBrightness":
        kind, bounds = "brightness", f
    else:
        kind, bounds = "contrast", (1.0 - f[0], 1.0 + f[1])
    return RandomPixel(tuple(shapes[0]), kind, bounds, spec.args["value_range"], ctx.index)


def _identity_onnx(g, spec, weights) -> None:
    g.out(g.x(0))


ENTRIES = {
    "RandomBrightness": Entry(
        _parse,
        _build,
        _identity_onnx,
        doc="`factor`, `value_range`; training only; Keras 3's delta (uniform in factor × "
        "the range, one per image) added, then clipped to the range; identity in predict and "
        "export",
    ),
    "RandomContrast": Entry(
        _parse,
        _build,
        _identity_onnx,
        doc="`factor`, `value_range`; training only; Keras 3's factor (uniform in "
        "[1 - lower, 1 + upper], one per image) about each channel's mean, then clipped to "
        "the range; identity in predict and export",
    ),
}
