"""Keras weight regularizers ``L1``, ``L2``, ``L1L2``: the loss term and its gradient.

Keras adds ``l1 * sum(|w|) + l2 * sum(w²)`` to the loss of every step, so every worker's
gradient carries ``l1 * sign(w) + 2 * l2 * w``; the term is the same on every replica and
survives the ring's average unchanged. :meth:`Regularizer.add_grad` adds it in place with one
planned scratch array (no allocation per step); :meth:`Regularizer.loss` is the value the
logged loss includes, as Keras' does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Keras class name → its default (l1, l2)
_DEFAULTS = {"L1": (0.01, 0.0), "L2": (0.0, 0.01), "L1L2": (0.0, 0.0)}
_ALIASES = {"l1": "L1", "l2": "L2", "l1_l2": "L1L2", "L1L2": "L1L2"}


@dataclass(frozen=True)
class Regularizer:
    l1: float = 0.0
    l2: float = 0.0

    def loss(self, w: np.ndarray, scratch: np.ndarray | None = None) -> float:
        """The penalty; with ``scratch`` (shaped like ``w``) nothing is allocated."""
        total = 0.0
        if self.l1:
            a = np.abs(w, out=scratch) if scratch is not None else np.abs(w)
            total += self.l1 * float(a.sum(dtype=np.float64))
        if self.l2:
            total += self.l2 * float(np.dot(w.ravel(), w.ravel()))
        return total

    def add_grad(self, w: np.ndarray, grad: np.ndarray, scratch: np.ndarray) -> None:
        """``grad += l1 * sign(w) + 2 * l2 * w`` (``scratch`` shaped like ``w``)."""
        if self.l1:
            np.sign(w, out=scratch)
            np.multiply(scratch, self.l1, out=scratch)
            np.add(grad, scratch, out=grad)
        if self.l2:
            np.multiply(w, 2.0 * self.l2, out=scratch)
            np.add(grad, scratch, out=grad)


def parse(doc, where: str = "kernel_regularizer") -> Regularizer | None:
    """A Keras regularizer as a config holds it (None, ``"l2"``, ``{"class_name": "L1L2",
    "config": {"l1": ..., "l2": ...}}``) → :class:`Regularizer`; ``ValueError`` naming
    ``where`` for anything else (``OrthogonalRegularizer``, custom ones)."""
    if doc is None:
        return None
    name = doc if isinstance(doc, str) else doc.get("class_name") if isinstance(doc, dict) else None
    cls = _ALIASES.get(name, name) if isinstance(name, str) else None
    if cls not in _DEFAULTS:
        raise ValueError(f"{where}={doc!r} is not supported (supported: L1, L2, L1L2)")
    l1, l2 = _DEFAULTS[cls]
    cfg = doc.get("config") or {} if isinstance(doc, dict) else {}
    unknown = set(cfg) - {"l1", "l2"}
    if unknown:
        raise ValueError(f"{where}.config.{sorted(unknown)[0]}: {cls} argument not supported")
    l1, l2 = float(cfg.get("l1", l1)), float(cfg.get("l2", l2))
    if l1 < 0 or l2 < 0:
        raise ValueError(f"{where}: l1={l1}, l2={l2} must not be negative")
    return Regularizer(l1, l2)


def keras(reg: Regularizer) -> dict:
    """The regularizer serialized as Keras writes it (``keras.regularizers.serialize``)."""
    cls = "L1L2" if reg.l1 and reg.l2 else "L1" if reg.l1 else "L2" if reg.l2 else "L1L2"
    cfg = {"L1": {"l1": reg.l1}, "L2": {"l2": reg.l2}, "L1L2": {"l1": reg.l1, "l2": reg.l2}}
    return {
        "module": "keras.regularizers",
        "class_name": cls,
        "config": cfg[cls],
        "registered_name": None,
    }
