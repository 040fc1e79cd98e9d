"""Parameter specs: what the plan lays out and the initialisers read; pure."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParamSpec:
    """One trainable tensor: its layer, shape, and Keras' fan-in/fan-out for Glorot init."""

    layer: int
    name: str
    shape: tuple[int, ...]
    fan_in: int
    fan_out: int
    glorot: bool
    #: initialised to ones (BatchNormalization's gamma) rather than Glorot or zeros
    ones: bool = False
    #: the Keras initializer (``ops.initializers.Initializer``) when not Keras' default,
    #: which the ``glorot``/``ones`` flags describe; None: those flags
    init: Any = None
    #: the Keras weight regularizer (``ops.regularizers.Regularizer``), or None
    reg: Any = None
    #: the Keras weight constraint (``optim.constraints.Constraint``), or None
    constraint: Any = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows of the parameter's matrix view ``(size // shape[-1], shape[-1])``: the unit in
        which its gradient is computed and streamed in blocks (a Dense kernel's input rows, a
        conv kernel's im2col rows)."""
        return self.size // self.shape[-1] if self.shape else 1


@dataclass(frozen=True)
class Slot:
    """Where a parameter sits in the flat buffer."""

    spec: ParamSpec
    start: int
    stop: int


def gamma_beta(layer: int, c: int, scale: bool, center: bool) -> list[ParamSpec]:
    """A normalization's per-channel ``gamma`` (ones) and ``beta`` (zeros), each only where
    Keras' ``scale`` / ``center`` keeps it: Batch-, Layer- and GroupNormalization's alike."""
    ps = [ParamSpec(layer, "gamma", (c,), 0, 0, False, ones=True)] if scale else []
    return ps + ([ParamSpec(layer, "beta", (c,), 0, 0, False)] if center else [])
