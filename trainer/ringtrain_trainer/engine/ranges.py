"""The meaningful range of a numeric argument, one rule for every spec check: a layer's
(``keras.entry.Args.number``), an initializer's, a constraint's (``optim.constraints``), an
optimizer's (``optim.limits``), a metric's (``engine.keras_metrics``) and a loss's
(``engine.loss_spec``).

Why one place: Keras accepts some values that cannot train (``BatchNormalization(momentum=2)``,
Adam's ``epsilon=-1``, ``MaxNorm(-1)``) and they used to run to a "Succeeded" job with
non-finite statistics or untrained weights; each parser now asks :meth:`Range.fails` and refuses
naming the argument with :meth:`Range.text` as what is supported. A number here is a finite
``int`` or ``float`` (never a ``bool``, a string or NaN). Pure Python: the operator's spec check
(``ringtrain_trainer.sizing``) loads no numpy for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def is_number(v: Any) -> bool:
    """A finite ``int`` or ``float`` (``True`` is not a number here)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Range:
    """``lo``/``hi`` (None: unbounded), each closed unless ``*_open``; ``integer``: an int."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def fails(self, v: Any) -> bool:
        """Whether ``v`` is not a finite number (an int where needed) inside the range."""
        if not is_number(v) or (self.integer and not isinstance(v, int)):
            return True
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return True
        return self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)

    @property
    def text(self) -> str:
        """What a refusal says is supported: ``a number in [0, 1)``, ``an int ≥ 1``."""
        what = "an int" if self.integer else "a number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            a, b = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{what} in {a}{lo:g}, {hi:g}{b}"
        if lo is not None:
            return f"{what} {'>' if self.lo_open else '≥'} {lo:g}"
        if hi is not None:
            return f"{what} {'<' if self.hi_open else '≤'} {hi:g}"
        return "an int" if self.integer else "a finite number"


#: any finite number
FINITE = Range()
#: ≥ 0: a factor, an epsilon, a standard deviation
NON_NEGATIVE = Range(0.0)
#: > 0: a scale, a bound that divides
POSITIVE = Range(0.0, lo_open=True)
#: [0, 1]: a momentum, an interpolation rate
UNIT = Range(0.0, 1.0)
#: [0, 1): a decay rate that must forget, a drop rate
RATE = Range(0.0, 1.0, hi_open=True)
#: 1, 2, ...
COUNT = Range(1, integer=True)
