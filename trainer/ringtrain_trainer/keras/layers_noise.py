"""Registry entries of Keras' training-time noise layers (GaussianNoise, GaussianDropout,
AlphaDropout): the engine's ``ops.noise.Noise`` in training, the identity in predict and in the
ONNX export. Their ``seed`` is accepted and not used: the draws come from ``--seed``, the step
and the global example, as ``Dropout``'s masks (``engine/ops/noise.py`` says why)."""

from __future__ import annotations

from ringtrain_trainer.engine.ops.noise import Noise
from ringtrain_trainer.engine.ranges import NON_NEGATIVE, RATE
from ringtrain_trainer.keras.entry import Args, Entry


def _amount(a: Args, arg: str, top: float | None) -> float:
    return a.number(arg, None, NON_NEGATIVE if top is None else RATE)


def _parse(arg: str, top: float | None):
    def parse(a: Args) -> dict:
        args = {arg: _amount(a, arg, top)}
        noise = a.take("noise_shape")
        if noise is not None:
            a.refuse("noise_shape", noise, "None (one draw per value)")
        a.take("seed")
        a.done(arg)
        return args

    return parse


_MODES = {
    "GaussianNoise": ("gaussian_noise", "stddev", None),
    "GaussianDropout": ("gaussian_dropout", "rate", 1.0),
    "AlphaDropout": ("alpha_dropout", "rate", 1.0),
}


def _build(spec, shapes, ctx):
    mode, arg, _ = _MODES[spec.cls]
    return Noise(tuple(shapes[0]), mode, spec.args[arg], ctx.index)


def _identity_onnx(g, spec, weights) -> None:
    g.out(g.x(0))


ENTRIES = {
    cls: Entry(
        _parse(arg, top),
        _build,
        _identity_onnx,
        doc=f"`{arg}`; training only, draws from `--seed`, the step and the global example "
        "(any worker count), identity in predict and export",
    )
    for cls, (_, arg, top) in _MODES.items()
}
