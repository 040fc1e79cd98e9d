"""What a parsed Keras model costs, by arithmetic on its shapes: refuse before building anything.

Pipeline position: between ``keras.config.parse`` (a validated :class:`ModelConfig`) and
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

Shapes that do not fit (a window larger than its input) were refused by the parse already;
an input the engine cannot take (a Dense on an unflattened image) is refused by the build,
before the parameter layout exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras.config import ModelConfig
from ringtrain_trainer.keras.registry import REGISTRY

#: float32: weights and gradients each take 4 bytes per parameter
ITEMSIZE = 4


@dataclass(frozen=True)
class LayerCost:
    """One Keras layer: its output shape (no batch axis) and its trainable parameters."""

    name: str
    out_shape: tuple[int, ...]
    params: int
    #: weights held frozen (``trainable=False``): on the IPU, without a gradient
    frozen: int = 0


def costs(cfg: ModelConfig) -> list[LayerCost]:
    """Each layer's cost in model order: its output shape (``keras.config`` inferred it) and
    its trainable parameters (its registry entry's weights)."""
    out = []
    for s in cfg.layers:
        weights = REGISTRY[s.cls].weights(s.args, list(s.in_shapes))
        n = 0 if s.shares else sum(math.prod(w.shape) for w in weights if w.trainable)
        if s.args.get("trainable", True) is False:
            out.append(LayerCost(s.name, s.out_shape, 0, n))
        else:
            out.append(LayerCost(s.name, s.out_shape, n))
    return out


def need_bytes(cfg: ModelConfig, batch_per_ipu: int) -> int:
    """The least a training program of ``cfg`` holds on one IPU: its weights and gradients
    (float32), the input batch and the largest layer's output for ``batch_per_ipu`` examples.
    Never more than ``memory.plan_memory``'s total (tests/trainer/test_trainer_budget.py)."""
    rows = costs(cfg)
    acts = ITEMSIZE * batch_per_ipu * (math.prod(cfg.input_shape) + largest_held(cfg, rows))
    return ITEMSIZE * sum(2 * r.params + r.frozen for r in rows) + acts


def largest_held(cfg: ModelConfig, rows: list[LayerCost]) -> int:
    """The largest layer output a program surely holds, per example. A Conv2D directly
    followed by MaxPooling2D is left out: the engine may fuse the two and hold only the pooled
    output (``engine.ops.fused.ConvPool``'s compiled kernel keeps no conv map)."""
    held = [
        math.prod(r.out_shape)
        for i, r in enumerate(rows)
        if not (
            cfg.layers[i].cls == "Conv2D"
            and i + 1 < len(cfg.layers)
            and cfg.layers[i + 1].cls == "MaxPooling2D"
        )
    ]
    return max(held, default=0)


def check(cfg: ModelConfig, capacity_bytes: int, batch_per_ipu: int) -> None:
    """Refuse, with the numbers, a model whose :func:`need_bytes` exceeds ``capacity_bytes``;
    ``batch_per_ipu`` 0: the weights alone (an input whose free dimensions the data fixes)."""
    if need_bytes(cfg, batch_per_ipu) <= capacity_bytes:
        return
    rows = costs(cfg)
    params = sum(r.params for r in rows)
    largest = largest_held(cfg, rows)
    weights = 2 * ITEMSIZE * params
    acts = ITEMSIZE * batch_per_ipu * (math.prod(cfg.input_shape) + largest)
    top = sorted(rows, key=lambda r: -r.params)[:2]
    if not batch_per_ipu:  # an input with free dimensions: its weights alone are known
        raise InvalidSpec(
            f"model: {weights:,} bytes of float32 weights and gradients per IPU at least "
            f"({params:,} parameters), {capacity_bytes:,} available (ipuMemoryMB); largest "
            "layers: " + ", ".join(f"{r.name!r} {r.params:,} parameters" for r in top)
        )
    raise InvalidSpec(
        f"model: {weights + acts:,} bytes needed per IPU at least ({params:,} parameters: "
        f"{weights:,} bytes of float32 weights and gradients; the input and the largest "
        f"activation, {largest:,} values per example, for {batch_per_ipu} examples per IPU: "
        f"{acts:,}), {capacity_bytes:,} available (ipuMemoryMB); largest layers: "
        + ", ".join(f"{r.name!r} {r.params:,} parameters" for r in top)
    )
