"""The on-reduced callback: applies the optimizer to a reduced slice of gradients.

DDP's ``_hook_then_optimizer`` in one small object: the only place that starts an optimizer
step (``begin_step``, once per training step, before any gradient is final) and applies it
(``__call__`` on each reduced slice, possibly on the communication thread while backward
still runs). Slices past the parameters (the stop vote) are ignored.

It is also where a diverged step stops (issue 20): each slice is checked for a non-finite value
before it is applied, by one sum (:func:`finite`: exact, no allocation). With peers the slice
is the *reduced* gradient, identical on every worker, so every worker decides the same; the
first non-finite slice and everything after it in the step is not applied
(:attr:`OptimizerHook.nonfinite`) and the step loop fails the job. Backward streams the last
layer first, and a NaN loss makes that layer's gradient NaN, so in practice nothing of such a
step is applied. Measured on the cnn (347k parameters, batch 64, one core): 120 µs a step, about
1% of a 10 ms step; with peers it runs on the communication thread, beside backward.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer import trace
from ringtrain_trainer.engine.native import finite
from ringtrain_trainer.optim import Optimizer


class OptimizerHook:
    def __init__(self, optimizer: Optimizer, grads: np.ndarray, tracer: trace.Tracer = trace.OFF):
        self.optimizer, self.grads, self.tracer = optimizer, grads, tracer
        self.num_params = optimizer.params.size
        #: (start, stop) of this step's first slice with a non-finite gradient, or None
        self.nonfinite: tuple[int, int] | None = None
        #: this step's slices of Embedding rows, held until their squares are reduced
        self.deferred: list[tuple[int, int]] = []
        #: hold every slice until the step's verdict (loss scaling: ``apply_deferred`` or drop)
        self.hold = False

    def begin_step(self, epoch: int) -> None:
        self.nonfinite = None
        self.deferred.clear()
        self.optimizer.begin_step(epoch)

    def __call__(self, start: int, stop: int, checked: bool = False) -> None:
        """Apply (or hold) one slice; ``checked``: its gradient is already known finite."""
        stop = min(stop, self.num_params)
        if self.hold:
            if start < stop:
                self.deferred.append((start, stop))
            return
        sparse = self.optimizer.sparse
        if sparse is None:
            self._apply(start, stop, checked)
            return
        for a, b in sparse.ranges:  # Embedding rows wait for their squares (apply_deferred)
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                self._apply(start, lo, checked)
                self.deferred.append((lo, hi))
                start = hi
        self._apply(start, stop, checked)

    def apply_run(self, pieces: list[tuple[int, int]]) -> None:
        """A contiguous run of pieces (in arrival order) as one slice: one worker has nothing
        to overlap, and a slice per piece cost a finite check and an optimizer pass per layer
        (35 % of a small MLP's step, profiled). The updates are elementwise and the norms
        whole-tensor, so the result is the same; a non-finite run is redone piece by piece,
        so :attr:`nonfinite` names the same first piece as before."""
        start, stop = min(a for a, _ in pieces), max(b for _, b in pieces)
        stop = min(stop, self.num_params)
        if self.nonfinite is None and start < stop and finite(self.grads[start:stop]):
            self(start, stop, checked=True)
            return
        for a, b in pieces:
            self(a, b)

    def apply_deferred(self) -> None:
        """The Embedding rows' slices, once ``optimizer.sparse`` holds this step's squares."""
        for start, stop in self.deferred:
            self._apply(start, stop)
        self.deferred.clear()

    def _apply(self, start: int, stop: int, checked: bool = False) -> None:
        if start < stop and self.nonfinite is None:
            if not checked and not finite(self.grads[start:stop]):
                self.nonfinite = (start, stop)
                return
            t = self.tracer.now()
            self.optimizer.apply(self.grads, start, stop)
            self.tracer.add(trace.OPTIMIZER, "apply", t, value=stop - start)
