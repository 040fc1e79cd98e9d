"""The on-reduced callback: applies the optimizer to a reduced slice of gradients.

DDP's ``_hook_then_optimizer`` in one small object: the only place that starts an optimizer
step (``begin_step``, once per training step, before any gradient is final) and applies it
(``__call__`` on each reduced slice, possibly on the communication thread while backward
still runs). Slices past the parameters (the stop vote) are ignored.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer import trace
from ringtrain_trainer.optim import Optimizer


class OptimizerHook:
    def __init__(self, optimizer: Optimizer, grads: np.ndarray, tracer: trace.Tracer = trace.OFF):
        self.optimizer, self.grads, self.tracer = optimizer, grads, tracer
        self.num_params = optimizer.params.size

    def begin_step(self, epoch: int) -> None:
        self.optimizer.begin_step(epoch)

    def __call__(self, start: int, stop: int) -> None:
        stop = min(stop, self.num_params)
        if start < stop:
            t = self.tracer.now()
            self.optimizer.apply(self.grads, start, stop)
            self.tracer.add(trace.OPTIMIZER, "apply", t, value=stop - start)
