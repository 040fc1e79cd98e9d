"""Loss scaling with Keras' ``LossScaleOptimizer`` semantics, decided alike on every worker.

Float16 gradients underflow; the loss (its gradient, dloss/doutput) is multiplied by a scale S
before backward and the reduced gradient divided by S before the optimizer. ``dynamic`` (Keras'
default, ``initial_scale`` 2**15, ``dynamic_growth_steps`` 2000): a step whose reduced gradient
has an inf or NaN is skipped (no update, the optimizer's ``iterations`` not counted) and S
halves; after ``growth_steps`` applied steps in a row S doubles (Keras 3: the step that reaches
the count is applied with the old scale, then S doubles). ``static``: S never changes and a
non-finite gradient fails the job as in fp32. ``off``: S = 1.

Every worker decides alike because the decision reads the *reduced* gradient: an inf on one
worker is an inf (or NaN) in the sum every worker receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringtrain_trainer.engine.native import finite

#: Keras' LossScaleOptimizer defaults
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000
#: the modes of ``--loss-scaling``
MODES = ("dynamic", "static", "off")
#: the checkpoint's optimizer-state key of a dynamic scale: (scale, counter)
STATE_KEY = "loss_scale"


@dataclass
class LossScale:
    mode: str = "off"
    scale: float = 1.0
    growth_steps: int = GROWTH_STEPS
    #: applied steps since the last change of scale (Keras' ``step_counter``)
    counter: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"loss scaling must be one of {MODES}, got {self.mode!r}")
        if self.mode == "off":
            self.scale = 1.0

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    @property
    def active(self) -> bool:
        """Whether gradients arrive scaled (and updates wait for the step's verdict)."""
        return self.mode != "off"

    def update(self, finite: bool) -> bool:
        """The step's verdict (its reduced gradient finite or not): whether to apply it, with
        the scale as it was in backward; then the scale for the next step (Keras 3 order)."""
        if not self.dynamic:
            return finite
        if not finite:
            self.counter = 0
            self.scale *= 0.5
            self.skipped += 1
            return False
        if self.counter == self.growth_steps - 1:
            self.counter = 0
            self.scale *= 2.0
        else:
            self.counter += 1
        return True

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps of a dynamic scale (Keras keeps both as variables)."""
        if not self.dynamic:
            return {}
        return {STATE_KEY: np.array([self.scale, self.counter], np.float64)}

    def load(self, state: dict) -> None:
        """Resume the scale a checkpoint kept (a checkpoint without one: as configured)."""
        v = state.get(STATE_KEY)
        if self.dynamic and v is not None and v.shape == (2,):
            self.scale, self.counter = float(v[0]), int(v[1])

    def settle(self, grads: np.ndarray, hook, optimizer) -> bool | None:
        """After a step's reduction: apply the held updates unscaled, or drop them. True:
        applied; False: skipped (dynamic); None: a static scale met a non-finite gradient
        (``hook.nonfinite`` is set, the job fails as in fp32). ``grads``: the reduced
        gradient, the same on every worker, so every worker settles alike."""
        scale = self.scale
        if self.update(finite(grads)):
            np.multiply(grads, np.float32(1.0 / scale), out=grads)
            hook.apply_deferred()
            return True
        hook.deferred.clear()
        if not self.dynamic:
            hook.nonfinite = (0, grads.size)
            return None
        optimizer.iterations -= 1  # Keras: a skipped step is not an iteration
        return False

    def record(self) -> dict:
        """For /status and the start-up line."""
        return {
            "mode": self.mode,
            "scale": self.scale,
            "growth_steps": self.growth_steps,
            "skipped_steps": self.skipped,
        }
