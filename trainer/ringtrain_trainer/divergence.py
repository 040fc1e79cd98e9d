"""Training health: a diverged step fails the job, naming the step, the worker and the tensor.

Pipeline position: the step loop (``worker.Trainer``) asks :func:`check_step` after every step's
reduction, and :func:`check_params` before a checkpoint or an export is written. The per-step
test itself is in the optimizer hook (``reducer.hook``): one sum per reduced slice, so the
healthy path allocates nothing and agrees on every worker (the reduced gradient is the same
bytes everywhere). Only once something is non-finite does this module look element by element,
to name the first non-finite tensor.

Why (issue 20): ``learningRate: 1e308`` or one +inf pixel gave a NaN loss, exit 0, a NaN model
exported, and NaN checkpoints rotating every good one out. Now such a step is not applied, no
checkpoint or export is written from non-finite parameters, and the worker exits
``EXIT_DIVERGED`` (3, permanent) with the reason in its termination log.
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain.errors import Diverged
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.engine.native import finite

ADVICE = "lower the learning rate, or look for inf/NaN in the data"


def first_nonfinite(spec: ModelSpec, flat: np.ndarray, lo: int = 0, hi: int | None = None) -> str:
    """``dense_1/kernel[3, 7] = nan``: the first non-finite element of ``flat[lo:hi]`` by its
    layer, parameter and index; "" when there is none. Allocates: the failure path only."""
    hi = flat.size if hi is None else hi
    bad = np.flatnonzero(~np.isfinite(flat[lo:hi]))
    if not bad.size:
        return ""
    i = lo + int(bad[0])
    slot = next((s for s in spec.slots if s.start <= i < s.stop), None)
    if slot is None:
        return f"element {i} = {flat[i]}"
    layer = getattr(spec.layers[slot.spec.layer], "name", "") or f"layer {slot.spec.layer}"
    at = ", ".join(map(str, np.unravel_index(i - slot.start, slot.spec.shape)))
    return f"{layer}/{slot.spec.name}[{at}] = {flat[i]}"


def check_step(
    spec: ModelSpec, grads: np.ndarray, nonfinite: tuple[int, int] | None, loss: float, where: str
) -> None:
    """After a step's reduction: raise :class:`Diverged` if its reduced gradient (checked by
    the hook, the same verdict on every worker) or this worker's loss is not finite.
    ``where``: ``step 3 rank 1``."""
    if nonfinite is not None:
        tensor = first_nonfinite(spec, grads, *nonfinite) or f"elements {nonfinite}"
        raise Diverged(
            f"{where}: training diverged: the reduced gradient of {tensor} is not finite "
            f"(the first non-finite tensor, last layer first; local loss {loss}); the step was "
            f"not applied and nothing is saved from it: {ADVICE}"
        )
    if not math.isfinite(loss):
        raise Diverged(
            f"{where}: training diverged: the loss is {loss} with finite gradients; the step "
            f"is not saved: {ADVICE}"
        )


def check_params(spec: ModelSpec, params: np.ndarray, where: str, what: str) -> None:
    """Before ``what`` (a checkpoint, an export) is written: parameters that became non-finite
    from finite gradients (an overflowing learning rate) are refused, so a good checkpoint is
    never rotated out by a NaN one."""
    if finite(params):
        return
    raise Diverged(
        f"{where}: training diverged: the parameter {first_nonfinite(spec, params)} is not "
        f"finite; {what} not written (the last good checkpoint is kept): {ADVICE}"
    )
