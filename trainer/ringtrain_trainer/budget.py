"""What a parsed Keras model costs, by arithmetic on its shapes: refuse before building anything.

Pipeline position: between ``keras_config.parse`` (a validated :class:`ModelConfig`) and
``keras_model.KerasModel`` (the IPU layers and the flat parameter layout). Building a model is
proportional to its size — the parameter layout lists every streamed gradient piece (one per
``model.GRAD_BLOCK_ELEMS`` elements), ``init`` allocates every parameter — so a 2 KB spec with
``Dense(units: 1e10)`` made the operator's spec check allocate 578 MiB (issue 20: over the
chart's 256Mi limit, a crash loop for every tenant). Here each layer's output shape and
parameter count are computed from integers alone, and a model whose float32 weights and
gradients plus one layer's activations for the per-IPU batch cannot fit ``ipuMemoryMB`` is
refused with the numbers. It is a lower bound of :func:`memory.plan_memory` (which also counts
workspace, data and every activation), so it never refuses what the IPU would compile; what
passes is at most ``ipuMemoryMB`` / 8 parameters, which bounds the build.

A layer whose input shape does not suit it (a Dense after a Conv2D without Flatten, a window
larger than its input) ends the walk: ``keras_model`` refuses it with its own words when it
maps that layer, before the parameter layout exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import keras_config as K

#: float32: weights and gradients each take 4 bytes per parameter
ITEMSIZE = 4


@dataclass(frozen=True)
class LayerCost:
    """One Keras layer: its output shape (no batch axis) and its trainable parameters."""

    name: str
    out_shape: tuple[int, ...]
    params: int


def _window(n: int, k: int, s: int, padding: str) -> int:
    return -(-n // s) if padding == "same" else (n - k) // s + 1


def _layer(s, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """(output shape, parameters) of Keras layer ``s`` on input ``shape``; None: it does not
    suit the input (``keras_model`` says why)."""
    if isinstance(s, (K.Conv2D, K.Pool2D)):
        if len(shape) != 3:
            return None
        (h, w, c), k = shape, s.kernel if isinstance(s, K.Conv2D) else s.pool
        ho, wo = (
            _window(n, kk, st, s.padding) for n, kk, st in zip((h, w), k, s.strides, strict=True)
        )
        if ho < 1 or wo < 1:
            return None
        if isinstance(s, K.Pool2D):
            return (ho, wo, c), 0
        return (ho, wo, s.filters), k[0] * k[1] * c * s.filters + s.filters * s.use_bias
    if isinstance(s, K.Dense):
        if len(shape) != 1:
            return None
        return (s.units,), shape[0] * s.units + s.units * s.use_bias
    if isinstance(s, K.GlobalAvgPool2D):
        return ((shape[-1],), 0) if len(shape) == 3 else None
    if isinstance(s, K.Flatten):
        return (math.prod(shape),), 0
    if isinstance(s, K.Reshape):
        t = list(s.target_shape)
        if t.count(-1) == 1:
            t[t.index(-1)] = math.prod(shape) // max(math.prod(d for d in t if d != -1), 1)
        if t.count(-1) or any(d < 1 for d in t) or math.prod(t) != math.prod(shape):
            return None
        return tuple(t), 0
    if isinstance(s, K.BatchNorm):
        return shape, shape[-1] * (s.center + s.scale)
    return shape, 0  # Activation, Rescaling, Dropout: elementwise


def costs(cfg: K.ModelConfig) -> list[LayerCost]:
    """Each layer's cost in model order, up to the first that does not suit its input."""
    out, shape = [], tuple(cfg.input_shape)
    for s in cfg.layers:
        got = _layer(s, shape)
        if got is None:
            break
        shape, n = got
        out.append(LayerCost(s.name, shape, n))
    return out


def need_bytes(cfg: K.ModelConfig, batch_per_ipu: int) -> int:
    """The least a training program of ``cfg`` holds on one IPU: its weights and gradients
    (float32), the input batch and the largest layer's output for ``batch_per_ipu`` examples.
    Never more than ``memory.plan_memory``'s total (tests/trainer/test_trainer_budget.py)."""
    rows = costs(cfg)
    largest = max((math.prod(r.out_shape) for r in rows), default=0)
    acts = ITEMSIZE * batch_per_ipu * (math.prod(cfg.input_shape) + largest)
    return 2 * ITEMSIZE * sum(r.params for r in rows) + acts


def check(cfg: K.ModelConfig, capacity_bytes: int, batch_per_ipu: int) -> None:
    """Refuse, with the numbers, a model whose :func:`need_bytes` exceeds ``capacity_bytes``."""
    if need_bytes(cfg, batch_per_ipu) <= capacity_bytes:
        return
    rows = costs(cfg)
    params = sum(r.params for r in rows)
    largest = max((math.prod(r.out_shape) for r in rows), default=0)
    weights = 2 * ITEMSIZE * params
    acts = ITEMSIZE * batch_per_ipu * (math.prod(cfg.input_shape) + largest)
    top = sorted(rows, key=lambda r: -r.params)[:2]
    raise InvalidSpec(
        f"model: {weights + acts:,} bytes needed per IPU at least ({params:,} parameters: "
        f"{weights:,} bytes of float32 weights and gradients; the input and the largest "
        f"activation, {largest:,} values per example, for {batch_per_ipu} examples per IPU: "
        f"{acts:,}), {capacity_bytes:,} available (ipuMemoryMB); largest layers: "
        + ", ".join(f"{r.name!r} {r.params:,} parameters" for r in top)
    )
