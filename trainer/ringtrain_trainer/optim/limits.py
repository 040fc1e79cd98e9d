"""The meaningful range of every optimizer argument, checked when ``compile_config.optimizer``
is read (``optim.registry.from_compile_config``), so ``render``, ``run`` and the operator's
admission refuse the same optimizer, naming the argument, before anything runs.

Keras accepts some of these values silently (Adam's ``epsilon=-1`` trains to 5.5 % and
"succeeds"); they cannot train meaningfully, so ringtrain refuses them (decision 0205). The
rules, one per argument name whichever optimizer takes it: a momentum in [0, 1], a decay rate
(``beta_1``, ``beta_2``, ``rho``) in [0, 1), an epsilon, an accumulator or a penalty ≥ 0, a
clipping bound > 0, Ftrl's ``learning_rate_power`` and Adafactor's ``beta_2_decay`` ≤ 0 (as
Keras' own checks), flags ``True``/``False``.
"""

from __future__ import annotations

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ranges import FINITE, NON_NEGATIVE, POSITIVE, RATE, UNIT, Range

#: argument → its range, for every optimizer that takes it (None accepted where Keras' default
#: is None: the feature is off)
RANGES: dict[str, Range] = {
    "momentum": UNIT,
    "beta_1": RATE,
    "beta_2": RATE,
    "rho": RATE,
    "epsilon": NON_NEGATIVE,
    "epsilon_1": NON_NEGATIVE,
    "epsilon_2": NON_NEGATIVE,
    "initial_accumulator_value": NON_NEGATIVE,
    "l1_regularization_strength": NON_NEGATIVE,
    "l2_regularization_strength": NON_NEGATIVE,
    "l2_shrinkage_regularization_strength": NON_NEGATIVE,
    "beta": NON_NEGATIVE,
    "learning_rate_power": Range(hi=0.0),
    "beta_2_decay": Range(hi=0.0),
    "clip_threshold": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "clipnorm": POSITIVE,
    "clipvalue": POSITIVE,
    "global_clipnorm": POSITIVE,
}
FLAGS = ("use_ema", "amsgrad", "nesterov", "centered", "relative_step")


def check(config: dict, where: str) -> None:
    """Refuse, naming the argument and its range, any value of ``config`` (an optimizer's
    Keras config, defaults filled in) outside :data:`RANGES`; the EMA's own with ``use_ema``."""
    for k, v in config.items():
        r = RANGES.get(k)
        if r is not None and v is not None and r.fails(v):
            raise InvalidSpec(f"model: {where}.{k}={v!r} is not supported (supported: {r.text})")
        if k in FLAGS and not isinstance(v, bool):
            raise InvalidSpec(f"model: {where}.{k}={v!r} is not supported (supported: a bool)")
    if not config.get("use_ema"):
        return
    m, every = config["ema_momentum"], config["ema_overwrite_frequency"]
    if UNIT.fails(m):
        raise InvalidSpec(f"model: {where}.ema_momentum={m!r} must be in [0, 1]")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise InvalidSpec(
            f"model: {where}.ema_overwrite_frequency={every!r} must be an integer >= 1 or None"
        )


#: a learning-rate schedule's arguments (``optim.schedules``): rates ≥ 0, step counts > 0
SCHEDULE_RANGES: dict[str, Range] = {
    "initial_learning_rate": NON_NEGATIVE,
    "end_learning_rate": NON_NEGATIVE,
    "warmup_target": NON_NEGATIVE,
    "decay_steps": POSITIVE,
    "first_decay_steps": POSITIVE,
    "warmup_steps": NON_NEGATIVE,
    "decay_rate": NON_NEGATIVE,
    "power": FINITE,
    "alpha": UNIT,
    "t_mul": POSITIVE,
    "m_mul": NON_NEGATIVE,
}


def check_schedule(config: dict, where: str) -> None:
    """A schedule's ``config`` against :data:`SCHEDULE_RANGES` (``values``: each a rate ≥ 0,
    ``boundaries``: each finite), refused naming the argument."""
    for k, v in config.items():
        if k in ("staircase", "cycle") and not isinstance(v, bool):
            raise InvalidSpec(f"model: {where}.{k}={v!r} is not supported (supported: a bool)")
        r = {"values": NON_NEGATIVE, "boundaries": FINITE}.get(k)
        if r is not None:
            bad = [x for x in (v if isinstance(v, list | tuple) else [v]) if r.fails(x)]
            if bad:
                raise InvalidSpec(
                    f"model: {where}.{k}: {bad[0]!r} is not supported (supported: each {r.text})"
                )
        r = SCHEDULE_RANGES.get(k)
        if r is not None and v is not None and r.fails(v):
            raise InvalidSpec(f"model: {where}.{k}={v!r} is not supported (supported: {r.text})")
