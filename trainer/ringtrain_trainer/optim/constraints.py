"""Keras weight constraints (``kernel_constraint=MaxNorm(3)`` & co.): a projection of the
variable, applied by the optimizer right after it has updated the whole tensor.

Keras' ``BaseOptimizer.apply`` assigns ``variable.constraint(variable)`` after every step's
update of that variable (a skipped loss-scaled step updates nothing and projects nothing). The
host optimizer updates the flat buffer in slices as the ring delivers them, so a constrained
tensor is projected once its last slice of the step is applied (:class:`Tracker`): the norms of
``MaxNorm`` are over whole columns, not slices. Every replica projects the same weights the
same way, so replicas stay bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringtrain_trainer.engine.ranges import NON_NEGATIVE, POSITIVE, UNIT

#: Keras' ``backend.epsilon()``, added to the norms before dividing
EPSILON = 1e-7
#: class name (and the snake_case aliases Keras accepts) → (its arguments with defaults)
_ARGS: dict[str, dict] = {
    "MaxNorm": {"max_value": 2.0, "axis": 0},
    "NonNeg": {},
    "UnitNorm": {"axis": 0},
    "MinMaxNorm": {"min_value": 0.0, "max_value": 1.0, "rate": 1.0, "axis": 0},
}
#: the meaningful range of each argument: a norm bound > 0 (MinMaxNorm's lower one ≥ 0, at most
#: its upper one), the rate of the projection in [0, 1]
_RANGES = {"max_value": POSITIVE, "min_value": NON_NEGATIVE, "rate": UNIT}
_ALIASES = {"max_norm": "MaxNorm", "non_neg": "NonNeg", "unit_norm": "UnitNorm"}
_ALIASES["min_max_norm"] = "MinMaxNorm"
SUPPORTED = tuple(_ARGS)


@dataclass(frozen=True)
class Constraint:
    """One Keras constraint; ``shape`` is the Keras weight's (the axes are Keras')."""

    cls: str
    args: dict = field(default_factory=dict)
    shape: tuple[int, ...] = ()

    def project(self, flat: np.ndarray, scratch: np.ndarray) -> None:
        """Project the tensor (its flat range) in place; ``scratch`` is as large as it."""
        w = flat.reshape(self.shape)
        if self.cls == "NonNeg":
            np.maximum(w, 0, out=w)
            return
        axis = self.args["axis"]
        axis = tuple(axis) if isinstance(axis, list | tuple) else axis
        sq = np.multiply(w, w, out=scratch.reshape(self.shape))
        norms = np.sqrt(np.sum(sq, axis=axis, keepdims=True, dtype=w.dtype))
        denom = norms + w.dtype.type(EPSILON)
        if self.cls == "UnitNorm":
            np.divide(w, denom, out=w)
            return
        a = self.args
        desired = np.clip(norms, a.get("min_value", 0.0), a["max_value"]).astype(w.dtype)
        if self.cls == "MinMaxNorm":
            desired = w.dtype.type(a["rate"]) * desired + w.dtype.type(1 - a["rate"]) * norms
        np.multiply(w, desired / denom, out=w)


def parse(doc, where: str = "kernel_constraint") -> Constraint | None:
    """A Keras constraint as a config holds it (None, ``"non_neg"``, ``{"class_name":
    "MaxNorm", "config": {...}}``) → :class:`Constraint`; ``ValueError`` naming ``where`` for
    anything else (a custom constraint)."""
    if doc is None:
        return None
    name = doc if isinstance(doc, str) else doc.get("class_name") if isinstance(doc, dict) else None
    cls = _ALIASES.get(name, name) if isinstance(name, str) else None
    if cls not in _ARGS:
        raise ValueError(f"{where}={doc!r} is not supported (supported: {', '.join(SUPPORTED)})")
    cfg = (doc.get("config") or {}) if isinstance(doc, dict) else {}
    unknown = set(cfg) - set(_ARGS[cls])
    if unknown:
        raise ValueError(f"{where}.config.{sorted(unknown)[0]}: {cls} argument not supported")
    args = {**_ARGS[cls], **cfg}
    for k, v in args.items():
        if k == "axis":
            axes = v if isinstance(v, list | tuple) else [v]
            if not axes or any(not isinstance(x, int) or isinstance(x, bool) for x in axes):
                raise ValueError(f"{where}.config.axis={v!r} is not an axis or a list of axes")
        elif _RANGES[k].fails(v):
            raise ValueError(f"{where}.config.{k}={v!r} is not {_RANGES[k].text}")
    if cls == "MinMaxNorm" and args["min_value"] > args["max_value"]:
        raise ValueError(
            f"{where}.config: min_value={args['min_value']!r} > max_value={args['max_value']!r}"
        )
    return Constraint(cls, args)


def keras(c: Constraint) -> dict:
    """The constraint serialized as Keras writes it (``keras.constraints.serialize``)."""
    return {"module": "keras.constraints", "class_name": c.cls, "config": dict(c.args)}


class Tracker:
    """Which constrained tensors this step has completed: ``applied(start, stop)`` after each
    slice's update returns the tensors whose last element that slice updated."""

    def __init__(self, ranges: list[tuple[int, int, Constraint]]):
        self.ranges = sorted(ranges, key=lambda t: t[0])
        self.left = [b - a for a, b, _ in self.ranges]

    def begin_step(self) -> None:
        self.left = [b - a for a, b, _ in self.ranges]

    def applied(self, start: int, stop: int) -> list[tuple[int, int, Constraint]]:
        done = []
        for i, (a, b, c) in enumerate(self.ranges):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                self.left[i] -= hi - lo
                if self.left[i] == 0:
                    done.append((a, b, c))
        return done
