"""Learning-rate schedules: Keras' ``keras.optimizers.schedules`` and the CLI's step decay.

Keras schedules are called with ``optimizer.iterations`` (the steps done before this one);
:meth:`value` takes that and the epoch, and each schedule reads the one it is defined on.
The formulas are ``keras/src/optimizers/schedules/learning_rate_schedule.py``'s, evaluated in
float64 (Keras computes in float32; the difference is below float32's resolution of the rate).
``from_keras`` reads the ``{"class_name": ..., "config": ...}`` serialization, refusing unknown
classes and arguments by their field path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.optim import limits


@dataclass(frozen=True)
class StepDecay:
    """``--lr-decay``: lr * decay ** (epoch // every_epochs); decay 1.0 is a constant rate."""

    lr: float = 1e-3
    decay: float = 1.0
    every_epochs: int = 1

    def __call__(self, epoch: int) -> float:
        return self.lr * self.decay ** (epoch // max(1, self.every_epochs))

    def value(self, iteration: int, epoch: int) -> float:
        return self(epoch)


class KerasSchedule:
    """A Keras schedule of the optimizer iteration; ``config`` is its full Keras config."""

    def value(self, iteration: int, epoch: int) -> float:
        return self(iteration)

    def __call__(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class ExponentialDecay(KerasSchedule):
    initial_learning_rate: float
    decay_steps: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step):
        p = step / self.decay_steps
        return self.initial_learning_rate * self.decay_rate ** (
            math.floor(p) if self.staircase else p
        )


@dataclass(frozen=True)
class InverseTimeDecay(KerasSchedule):
    initial_learning_rate: float
    decay_steps: float
    decay_rate: float
    staircase: bool = False

    def __call__(self, step):
        p = step / self.decay_steps
        return self.initial_learning_rate / (
            1 + self.decay_rate * (math.floor(p) if self.staircase else p)
        )


@dataclass(frozen=True)
class PiecewiseConstantDecay(KerasSchedule):
    boundaries: tuple = ()
    values: tuple = field(default=())

    def __call__(self, step):
        for b, v in zip(self.boundaries, self.values[:-1], strict=True):
            if step <= b:
                return v
        return self.values[-1]


@dataclass(frozen=True)
class PolynomialDecay(KerasSchedule):
    initial_learning_rate: float
    decay_steps: float
    end_learning_rate: float = 1e-4
    power: float = 1.0
    cycle: bool = False

    def __call__(self, step):
        steps = self.decay_steps
        if self.cycle:
            steps = steps * (1.0 if step == 0 else math.ceil(step / steps))
        else:
            step = min(step, steps)
        p = step / steps
        lr0, end = self.initial_learning_rate, self.end_learning_rate
        return (lr0 - end) * (1 - p) ** self.power + end


@dataclass(frozen=True)
class CosineDecay(KerasSchedule):
    initial_learning_rate: float
    decay_steps: float
    alpha: float = 0.0
    warmup_target: float | None = None
    warmup_steps: float = 0

    def _decay(self, step, lr):
        cos = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return lr * ((1 - self.alpha) * cos + self.alpha)

    def __call__(self, step):
        if self.warmup_target is None:
            return self._decay(min(step, self.decay_steps), self.initial_learning_rate)
        step = min(step, self.decay_steps + self.warmup_steps)
        if step < self.warmup_steps:
            delta = self.warmup_target - self.initial_learning_rate
            return delta * step / self.warmup_steps + self.initial_learning_rate
        return self._decay(step - self.warmup_steps, self.warmup_target)


@dataclass(frozen=True)
class CosineDecayRestarts(KerasSchedule):
    initial_learning_rate: float
    first_decay_steps: float
    t_mul: float = 2.0
    m_mul: float = 1.0
    alpha: float = 0.0

    def __call__(self, step):
        frac = step / self.first_decay_steps
        if self.t_mul == 1.0:
            i = math.floor(frac)
            frac -= i
        else:
            t = self.t_mul
            i = math.floor(math.log(1.0 - frac * (1.0 - t)) / math.log(t))
            frac = (frac - (1.0 - t**i) / (1.0 - t)) / t**i
        cos = 0.5 * self.m_mul**i * (1.0 + math.cos(math.pi * frac))
        return self.initial_learning_rate * ((1 - self.alpha) * cos + self.alpha)


SCHEDULES = {
    c.__name__: c
    for c in (
        ExponentialDecay,
        InverseTimeDecay,
        PiecewiseConstantDecay,
        PolynomialDecay,
        CosineDecay,
        CosineDecayRestarts,
    )
}


def from_keras(doc: dict, where: str) -> KerasSchedule:
    """A schedule from its Keras serialization; ``where`` names the field in messages."""
    cls_name = doc.get("class_name")
    cls = SCHEDULES.get(cls_name) if isinstance(cls_name, str) else None
    if cls is None:
        raise InvalidSpec(
            f"model: {where}: schedule {cls_name!r} is not supported "
            f"(supported: {', '.join(SCHEDULES)})"
        )
    cfg = dict(doc.get("config") or {})
    cfg.pop("name", None)
    names = set(cls.__dataclass_fields__)
    for k in cfg:
        if k not in names:
            raise InvalidSpec(
                f"model: {where}.config.{k}: argument {k!r} of {cls_name} is not supported"
            )
    limits.check_schedule(cfg, f"{where}.config")
    if cls is PiecewiseConstantDecay:
        cfg = {k: tuple(cfg.get(k) or ()) for k in ("boundaries", "values")}
        if len(cfg["values"]) != len(cfg["boundaries"]) + 1:
            raise InvalidSpec(f"model: {where}.config.values: needs one more value than boundaries")
    try:
        return cls(**cfg)
    except TypeError as e:
        raise InvalidSpec(f"model: {where}.config: {e}") from None
