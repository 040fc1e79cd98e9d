"""Does a program fit the IPU: its memory plan, with recomputation when asked, and the refusal.

Pipeline position: ``IPU.compile`` plans one IPU's memory for a batch (``ipu.memory``) and asks
:func:`fit` before allocating anything. Why its own module: the refusal is what a user reads when
a model is too big, so it says what would fit (recomputation, a larger IPU, a smaller batch) and
that advice is computed here, with the same plan the compile uses.
"""

from __future__ import annotations

from ringtrain.errors import IPUCompileError
from ringtrain_trainer.engine import recompute
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.ipu.config import IPUConfig
from ringtrain_trainer.ipu.memory import MemoryPlan


def fit(
    spec: ModelSpec,
    config: IPUConfig,
    plan: MemoryPlan,
    per_ipu: int,
    train: bool,
    itemsize: int,
) -> tuple[MemoryPlan, list[int]]:
    """The plan that runs (recomputation applied when ``config.recompute``) and its recompute
    cuts; :class:`IPUCompileError` when it exceeds the IPU, with the hint that recomputation
    would fit when it was not asked for and would."""
    cuts: list[int] = []
    if train and config.recompute:
        cuts = recompute.choose(spec, plan, per_ipu, itemsize, config.recompute_checkpoints)
        plan = recompute.plan(spec, plan, per_ipu, itemsize, cuts)
    if plan.total <= plan.capacity:
        return plan, cuts
    hint = ""
    if train and not config.recompute:
        rc = recompute.plan(
            spec, plan, per_ipu, itemsize, recompute.choose(spec, plan, per_ipu, itemsize)
        )
        if rc.total <= rc.capacity:
            hint = (
                f"; it fits with recomputation: {rc.total:,} bytes "
                "(--allow-recompute, spec.trainer.allowRecompute: true)"
            )
    raise IPUCompileError(
        f"model {spec.name!r} with batch {per_ipu} per IPU does not fit the IPU: "
        f"{plan.describe()} (raise --ipu-memory-mb or lower --batch-size){hint}"
    )
