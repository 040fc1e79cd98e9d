"""Registry entry of Keras' ``RandomFlip`` (``engine/ops/augment.py``): training only (with a
backward: a flip is a permutation); the identity in predict and in the ONNX export. The other image
augmentation layers (RandomRotation, RandomZoom, RandomTranslation, RandomContrast,
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
}
