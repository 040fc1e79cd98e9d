"""Gradient accumulation on the emulated IPU (Graphcore's ``gradient_accumulation_count``).

The IPU runs K micro-batches per optimizer step and sums their gradients on the device, in one
accumulator the size of the model's gradients (it shows in the memory report as gradients and
as its own ``(accumulator)`` row); only the K-th micro-batch streams its pieces to the host,
each already the mean over the K micro-batches. So the ring reduces once and the optimizer
steps once per K micro-batches, and — every loss being a mean over its batch — the step is the
step of one batch of K·B examples, for models whose layers do not couple the examples of a
batch (BatchNormalization's statistics are over B, not K·B, as on a real IPU).

The piece grid is the same for every micro-batch, so the sum is done piece by piece as backward
writes it: the first micro-batch copies, the middle ones add, the last adds the sum into the
streamed piece and scales it by 1/K. No allocation per step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ringtrain_trainer.ipu.memory import LayerMemory, MemoryPlan

#: the memory report's row for the accumulator
ACCUMULATOR_ROW = "(accumulator)"


class Accumulator:
    """The device-side sum of ``steps`` micro-batches' gradients (``size`` elements)."""

    def __init__(self, steps: int, size: int, dtype=np.float32):
        if steps < 1:
            raise ValueError(f"gradient accumulation steps must be at least 1, got {steps}")
        self.steps = steps
        self.sum = np.zeros(size if steps > 1 else 0, dtype)
        self._inv = np.dtype(dtype).type(1.0 / steps)

    def fold(self, grads: np.ndarray, start: int, stop: int, micro: int) -> bool:
        """Fold micro-batch ``micro``'s gradients ``grads[start:stop]`` into the sum; True when
        this is the last micro-batch and ``grads[start:stop]`` now holds the mean (stream it)."""
        if self.steps == 1:
            return True
        a, g = self.sum[start:stop], grads[start:stop]
        if micro == 0:
            np.copyto(a, g)
            return False
        if micro < self.steps - 1:
            np.add(a, g, out=a)
            return False
        np.add(g, a, out=g)
        np.multiply(g, self._inv, out=g)
        return True


def accumulator_bytes(steps: int, num_params: int, itemsize: int) -> int:
    """Device bytes of the accumulator: none without accumulation."""
    return num_params * itemsize if steps > 1 else 0


def with_accumulator(plan: MemoryPlan, nbytes: int) -> MemoryPlan:
    """``plan`` with the accumulator counted as gradients and shown as its own row."""
    if not nbytes:
        return plan
    rows = (*plan.by_layer, LayerMemory(ACCUMULATOR_ROW, gradients=nbytes))
    return dataclasses.replace(plan, gradients=plan.gradients + nbytes, by_layer=rows)
