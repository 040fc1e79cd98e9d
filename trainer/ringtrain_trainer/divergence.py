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

#: "Succeeded" means trained: dynamic loss scaling skips a step whose reduced gradient is not
#: finite (Keras' LossScaleOptimizer), but a run may skip only so many. The first few skips
#: are the scale finding its level (2**15 halves until gradients fit float16).
SKIP_GRACE = 8
#: ... or this share of the run's steps, whichever is more
SKIP_FRACTION = 0.05
#: ... and at most SKIP_WINDOW_MAX of any SKIP_WINDOW consecutive steps
SKIP_WINDOW, SKIP_WINDOW_MAX = 100, 25
#: a scale below 1 no longer protects anything: even the unscaled gradient overflows float16
LOSS_SCALE_FLOOR = 1.0


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


def first_nonfinite_state(spec: ModelSpec, state: np.ndarray) -> str:
    """``batch_normalization/moving_variance[3] = nan``: the first non-finite element of the
    model's non-trainable state by its layer and name; "" when there is none."""
    at = 0
    for i, (layer, specs) in enumerate(zip(spec.layers, spec.state_specs, strict=True)):
        for name, n, _ in specs:
            bad = np.flatnonzero(~np.isfinite(state[at : at + n]))
            if bad.size:
                k = int(bad[0])
                return f"{layer.name or f'layer {i}'}/{name}[{k}] = {state[at + k]}"
            at += n
    return ""


class Skips:
    """The run's steps skipped for a non-finite reduced gradient, against the bounds above:
    in all, over the last :data:`SKIP_WINDOW` steps, and the loss scale's floor. Fed once per
    step with the same verdict on every worker (the reduced gradient is the same bytes), so
    every worker fails at the same step with the same reason."""

    def __init__(self, total_steps: int) -> None:
        self.allowed = max(SKIP_GRACE, int(SKIP_FRACTION * total_steps))
        self.total = 0
        self._recent = np.zeros(SKIP_WINDOW, np.bool_)
        self._at = 0
        self._in_window = 0

    def record(self, skipped: bool, scale: float, where: str) -> None:
        """One step's verdict (``skipped``) and the loss scale after it; raises
        :class:`Diverged` naming the bound the run has crossed."""
        self._in_window += int(skipped) - int(self._recent[self._at])
        self._recent[self._at] = skipped
        self._at = (self._at + 1) % SKIP_WINDOW
        if not skipped:
            return
        self.total += 1
        if scale < LOSS_SCALE_FLOOR:
            why = f"the loss scale fell to {scale:g}, below {LOSS_SCALE_FLOOR:g}"
        elif self._in_window > SKIP_WINDOW_MAX:
            why = f"{self._in_window} of the last {SKIP_WINDOW} steps were skipped"
        elif self.total > self.allowed:
            why = (
                f"{self.total} steps of this run were skipped (at most {self.allowed}: "
                f"{SKIP_GRACE} or {SKIP_FRACTION:.0%} of its steps)"
            )
        else:
            return
        raise Diverged(
            f"{where}: training diverged: {why}; a skipped step's reduced gradient is not "
            f"finite in float16 ({self.total} skipped in all, loss scale {scale:g}): {ADVICE}"
        )


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


def check_params(
    spec: ModelSpec, params: np.ndarray, where: str, what: str, state: np.ndarray | None = None
) -> None:
    """Before ``what`` (a checkpoint, an export, the final result) is written: parameters that
    became non-finite from finite gradients (an overflowing learning rate), or model ``state``
    (moving statistics, e.g. a BatchNormalization ``momentum`` outside [0, 1]) that did, are
    refused, so a good checkpoint is never rotated out by a NaN one and a job never succeeds
    with a model that cannot predict."""
    if state is not None and state.size and not finite(state):
        raise Diverged(
            f"{where}: training diverged: the model state {first_nonfinite_state(spec, state)} "
            f"is not finite; {what} not written (the last good checkpoint is kept): {ADVICE}"
        )
    if finite(params):
        return
    raise Diverged(
        f"{where}: training diverged: the parameter {first_nonfinite(spec, params)} is not "
        f"finite; {what} not written (the last good checkpoint is kept): {ADVICE}"
    )
