"""A compiled program of the emulated IPU: what ``IPU.compile`` returns and every run reads.

Pipeline position: ``ipu.device.IPU.compile`` (and ``ipu.pipeline``) build an :class:`Executable`
once per batch size; the step runs it, the memory report reads its plans. Its own module because
the device and the pipeline both build one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringtrain_trainer.engine.model import Program
from ringtrain_trainer.ipu.memory import MemoryPlan


@dataclass
class Executable:
    """A compiled program: one :class:`Program` per shard (replica x host thread), the shards
    each host thread runs, and the memory plan of one IPU."""

    batch: int
    train: bool
    plan: MemoryPlan
    programs: list[Program]
    grads: list[list[dict[str, np.ndarray]]] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    flops_per_run: int = 0
    losses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: with recomputation, the plan without it (the report shows both)
    baseline: MemoryPlan | None = None
    #: a pipeline's (``ipu.pipeline``): each stage's plan, in stage order; None otherwise
    stage_plans: list[MemoryPlan] | None = None


def add_output_losses(exe: Executable, parts: np.ndarray | None) -> np.ndarray | None:
    """Adds the programs' mean per-output losses of one micro-batch to ``parts`` (None:
    a model with one output)."""
    first = exe.programs[0].loss
    if not hasattr(first, "parts"):
        return None
    mean = sum(p.loss.parts for p in exe.programs) / len(exe.programs)
    return mean if parts is None else parts + mean
