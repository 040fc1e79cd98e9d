"""Keras initializers as seeded numpy: a class-name registry, each entry a sampler with Keras'
arguments and distribution.

Why the values need not match Keras bit for bit: a model's starting weights come from its
``.keras`` file; these run only where there is none (the presets, a layer added by ringtrain),
so what must match is the distribution and its scale — what the tests check, moment by moment.
Fans are Keras' ``compute_fans``: a kernel ``(*receptive, in, out)`` has ``fan_in = in *
prod(receptive)`` and ``fan_out = out * prod(receptive)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: the truncated normal's standard deviation at ±2σ, relative to the untruncated one
_TRUNC_STD = 0.87962566103423978


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def truncated_normal(rng, shape, mean: float, stddev: float) -> np.ndarray:
    """Normal draws redrawn until all lie within two standard deviations."""
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2
    return out * stddev + mean


def _variance_scaling(rng, shape, scale=1.0, mode="fan_in", distribution="truncated_normal"):
    fan_in, fan_out = fans(shape)
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[mode]
    scale /= max(1.0, n)
    if distribution in ("truncated_normal", "normal"):
        return truncated_normal(rng, shape, 0.0, math.sqrt(scale) / _TRUNC_STD)
    if distribution == "untruncated_normal":
        return rng.normal(0.0, math.sqrt(scale), shape)
    limit = math.sqrt(3.0 * scale)
    return rng.uniform(-limit, limit, shape)


def _orthogonal(rng, shape, gain=1.0):
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (1, shape[0])
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return gain * q.reshape(shape)


def _identity(rng, shape, gain=1.0):
    if len(shape) != 2:
        raise ValueError(f"Identity initializer needs a 2-D shape, got {shape}")
    return gain * np.eye(*shape)


_SAMPLERS: dict[str, tuple[Callable, dict]] = {
    "VarianceScaling": (_variance_scaling, {"scale": 1.0, "mode": "fan_in",
                                            "distribution": "truncated_normal"}),
    "GlorotUniform": (_variance_scaling, {"scale": 1.0, "mode": "fan_avg",
                                          "distribution": "uniform"}),
    "GlorotNormal": (_variance_scaling, {"scale": 1.0, "mode": "fan_avg"}),
    "HeNormal": (_variance_scaling, {"scale": 2.0}),
    "HeUniform": (_variance_scaling, {"scale": 2.0, "distribution": "uniform"}),
    "LecunNormal": (_variance_scaling, {"scale": 1.0}),
    "LecunUniform": (_variance_scaling, {"scale": 1.0, "distribution": "uniform"}),
    "RandomNormal": (lambda rng, s, mean=0.0, stddev=0.05: rng.normal(mean, stddev, s),
                     {"mean": 0.0, "stddev": 0.05}),
    "RandomUniform": (lambda rng, s, minval=-0.05, maxval=0.05: rng.uniform(minval, maxval, s),
                      {"minval": -0.05, "maxval": 0.05}),
    "TruncatedNormal": (truncated_normal, {"mean": 0.0, "stddev": 0.05}),
    "Zeros": (lambda rng, s: np.zeros(s), {}),
    "Ones": (lambda rng, s: np.ones(s), {}),
    "Constant": (lambda rng, s, value=0.0: np.full(s, value, np.float64), {"value": 0.0}),
    "Orthogonal": (_orthogonal, {"gain": 1.0}),
    "Identity": (_identity, {"gain": 1.0}),
}  # fmt: skip
#: the presets' arguments, which the user may not override
_FIXED = {"GlorotUniform", "GlorotNormal", "HeNormal", "HeUniform", "LecunNormal", "LecunUniform"}
SUPPORTED = tuple(_SAMPLERS)
_ALIASES = {
    "OrthogonalInitializer": "Orthogonal",
    "IdentityInitializer": "Identity",
    "random_normal": "RandomNormal",
    "random_uniform": "RandomUniform",
    "uniform": "RandomUniform",
    "normal": "RandomNormal",
}
#: config keys that change no distribution (the seed: ringtrain seeds from ``--seed``)
_BOOKKEEPING = ("seed", "input_axes", "output_axes")


def _snake(name: str) -> str:
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


_BY_SNAKE = {_snake(k): k for k in _SAMPLERS}


@dataclass(frozen=True)
class Initializer:
    """A validated Keras initializer: class name and the arguments that shape it."""

    name: str
    args: dict = field(default_factory=dict)

    def __call__(self, shape, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
        fn, defaults = _SAMPLERS[self.name]
        return np.asarray(fn(rng, tuple(shape), **{**defaults, **self.args}), dtype)


def full(init: Initializer) -> tuple[str, dict]:
    """The initializer with its defaults filled in: equal for equal distributions."""
    return init.name, {**_SAMPLERS[init.name][1], **init.args}


def parse(doc, where: str = "initializer") -> Initializer:
    """A Keras initializer as a config holds it (``"he_normal"``, ``{"class_name":
    "VarianceScaling", "config": {...}}``) → :class:`Initializer`; ``ValueError`` naming
    ``where`` and the argument for what is not supported."""
    if isinstance(doc, str):
        name = _ALIASES.get(doc) or _BY_SNAKE.get(doc) or (doc if doc in _SAMPLERS else None)
        if name is None:
            raise ValueError(
                f"{where}={doc!r} is not supported (supported: {', '.join(SUPPORTED)})"
            )
        return Initializer(name)
    if not isinstance(doc, dict) or not isinstance(doc.get("class_name"), str):
        raise ValueError(f"{where}={doc!r} is not supported (a name or a class_name/config)")
    init = parse(doc["class_name"], where)
    args = {}
    defaults = _SAMPLERS[init.name][1]
    for k, v in (doc.get("config") or {}).items():
        if k in _BOOKKEEPING and (k == "seed" or v is None):
            continue
        if k not in defaults or init.name in _FIXED:
            raise ValueError(f"{where}.config.{k}={v!r}: {init.name} argument not supported")
        args[k] = v
    if init.name == "VarianceScaling":
        mode, dist = args.get("mode", "fan_in"), str(args.get("distribution", "truncated_normal"))
        if mode not in ("fan_in", "fan_out", "fan_avg"):
            raise ValueError(f"{where}.config.mode={mode!r} is not supported")
        if dist.lower() not in ("truncated_normal", "normal", "untruncated_normal", "uniform"):
            raise ValueError(f"{where}.config.distribution={dist!r} is not supported")
        if float(args.get("scale", 1.0)) <= 0:
            raise ValueError(f"{where}.config.scale must be positive")
        args["distribution"] = dist.lower()
    return Initializer(init.name, args)
