"""Registry entries of Keras' ``RandomFlip`` and ``RandomRotation`` (``engine/ops/augment.py``):
training only (both linear in the image, with a backward); the identity in predict and in the
ONNX export. The other image augmentation layers (RandomZoom, RandomTranslation, RandomContrast,
RandomBrightness, RandomCrop) are not registered, so they are refused by name."""

from __future__ import annotations

from ringtrain_trainer.keras.entry import Args, Entry, need_rank


def _flip_parse(a: Args) -> dict:
    from ringtrain_trainer.engine.ops.augment import FLIP_MODES

    mode = a.must_be("mode", "horizontal_and_vertical", "horizontal", "vertical")
    assert mode in FLIP_MODES
    a.channels_last()
    a.take("seed")  # the draws come from --seed, the step and the example
    a.done("mode")
    return {"mode": mode, "data_format": "channels_last"}


def _flip_build(spec, shapes, ctx):
    from ringtrain_trainer.engine.ops.augment import RandomFlip

    need_rank(spec, tuple(shapes[0]), 3, "(height, width, channels) images")
    return RandomFlip(tuple(shapes[0]), spec.args["mode"], ctx.index)


def _rotation_parse(a: Args) -> dict:
    f = a.take("factor")
    num = (int, float)
    if isinstance(f, num) and not isinstance(f, bool) and f >= 0:
        factor = [-float(f), float(f)]
    elif isinstance(f, (list, tuple)) and len(f) == 2 and all(isinstance(v, num) for v in f):
        factor = [float(f[0]), float(f[1])]
    else:
        a.refuse("factor", f, "a number ≥ 0 or (lower, upper)")
    fill = a.must_be("fill_mode", "reflect", "wrap", "constant", "nearest")
    interp = a.must_be("interpolation", "bilinear", "nearest")
    value = a.take("fill_value", 0.0)
    if not isinstance(value, num) or isinstance(value, bool):
        a.refuse("fill_value", value, "a number")
    a.channels_last()
    a.take("seed")
    a.done("factor, fill_mode, interpolation, fill_value")
    return {
        "factor": factor,
        "fill_mode": fill,
        "interpolation": interp,
        "fill_value": float(value),
        "data_format": "channels_last",
    }


def _rotation_build(spec, shapes, ctx):
    from ringtrain_trainer.engine.ops.augment import RandomRotation

    need_rank(spec, tuple(shapes[0]), 3, "(height, width, channels) images")
    a = spec.args
    return RandomRotation(
        tuple(shapes[0]),
        a["factor"],
        a["fill_mode"],
        a["interpolation"],
        a["fill_value"],
        ctx.index,
    )


def _identity_onnx(g, spec, weights) -> None:
    g.out(g.x(0))


ENTRIES = {
    "RandomFlip": Entry(
        _flip_parse,
        _flip_build,
        _identity_onnx,
        doc="`mode`; training only; Keras 3's draw (one per image, "
        "≤ 0.5 flips; both axes at once for horizontal_and_vertical) from `--seed`, the step "
        "and the global example; identity in predict and export",
    ),
    "RandomRotation": Entry(
        _rotation_parse,
        _rotation_build,
        _identity_onnx,
        doc="`factor`, `fill_mode`, `interpolation` (nearest, bilinear), `fill_value`; training "
        "only; Keras 3's angle (uniform in "
        "factor × 360°) from `--seed`, the step and the global example, sampled as Keras' "
        "`ops.image.affine_transform`; identity in predict and export",
    ),
}
