"""Registry entries of Keras' ``RandomFlip``, ``RandomRotation``, ``RandomTranslation`` and
``RandomZoom`` (``engine/ops/augment.py``): training only (all linear in the image, with a
backward); the identity in predict and in the ONNX export. RandomContrast and RandomBrightness:
``layers_augment_pixel``; RandomCrop is not registered, so it is refused by name."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.augment import FLIP_MODES, RandomAffine, RandomFlip
from ringtrain_trainer.keras.entry import Args, Entry, need_rank


def _flip_parse(a: Args) -> dict:
    mode = a.must_be("mode", "horizontal_and_vertical", "horizontal", "vertical")
    assert mode in FLIP_MODES
    a.channels_last()
    a.take("seed")  # the draws come from --seed, the step and the example
    a.done("mode")
    return {"mode": mode, "data_format": "channels_last"}


def _flip_build(spec, shapes, ctx):
    need_rank(spec, tuple(shapes[0]), 3, "(height, width, channels) images")
    return RandomFlip(tuple(shapes[0]), spec.args["mode"], ctx.index)


def _factor(a: Args, arg: str) -> list[float]:
    """Keras' ``factor``: a number ``f`` is ``(-f, f)``, else ``(lower, upper)``."""
    f = a.take(arg)
    num = (int, float)
    if isinstance(f, num) and not isinstance(f, bool) and f >= 0:
        return [-float(f), float(f)]
    pair = isinstance(f, (list, tuple)) and len(f) == 2 and all(isinstance(v, num) for v in f)
    if pair and f[0] <= f[1]:
        return [float(f[0]), float(f[1])]
    a.refuse(arg, f, "a number ≥ 0 or (lower, upper) with lower ≤ upper")
    raise AssertionError  # refuse raises


def _affine_parse(*factors: str):
    def parse(a: Args) -> dict:
        optional = "width_factor" if a.cls == "RandomZoom" else None
        args: dict = {
            k: None if k == optional and a.cfg.get(k) is None else _factor(a, k) for k in factors
        }
        if args.get(optional or "") is None:
            a.take(optional or "width_factor")
        args["fill_mode"] = a.must_be("fill_mode", "reflect", "wrap", "constant", "nearest")
        args["interpolation"] = a.must_be("interpolation", "bilinear", "nearest")
        value = a.take("fill_value", 0.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            a.refuse("fill_value", value, "a number")
        args["fill_value"] = float(value)
        args["data_format"] = a.channels_last()
        a.take("seed")
        a.done(", ".join((*factors, "fill_mode", "interpolation", "fill_value")))
        return args

    return parse


def _affine_build(spec, shapes, ctx):
    need_rank(spec, tuple(shapes[0]), 3, "(height, width, channels) images")
    a = spec.args
    kind = {"RandomRotation": "rotation", "RandomTranslation": "translation"}.get(spec.cls, "zoom")
    names = ("factor",) if kind == "rotation" else ("height_factor", "width_factor")
    factors = [a[k] for k in names if a[k] is not None]
    fill = (a["fill_mode"], a["interpolation"], a["fill_value"])
    return RandomAffine(tuple(shapes[0]), kind, factors, *fill, ctx.index)


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
        _affine_parse("factor"),
        _affine_build,
        _identity_onnx,
        doc="`factor`, `fill_mode`, `interpolation` (nearest, bilinear), `fill_value`; training "
        "only; Keras 3's angle (uniform in factor × 360°) from `--seed`, the step and the "
        "global example, sampled as Keras' `ops.image.affine_transform`; identity in predict "
        "and export",
    ),
    "RandomTranslation": Entry(
        _affine_parse("height_factor", "width_factor"),
        _affine_build,
        _identity_onnx,
        doc="`height_factor`, `width_factor`, `fill_mode`, `interpolation`, `fill_value`; "
        "training only; Keras 3's shifts (uniform in the factors × the side) from `--seed`, "
        "the step and the global example, sampled as Keras' `ops.image.affine_transform`; "
        "identity in predict and export",
    ),
    "RandomZoom": Entry(
        _affine_parse("height_factor", "width_factor"),
        _affine_build,
        _identity_onnx,
        doc="`height_factor`, `width_factor` (None: the height's draw), `fill_mode`, "
        "`interpolation`, `fill_value`; training only; Keras 3's zooms (1 + uniform in the "
        "factors) from `--seed`, the step and the global example, sampled as Keras' "
        "`ops.image.affine_transform`; identity in predict and export",
    ),
}
