"""What numbers a run computes in: precision, loss scaling and stochastic rounding, resolved once
from the flags and the model's own Keras settings (each flag given overriding its part).

The model's side (``keras.compile``): a ``mixed_float16`` dtype policy means fp16; a
``LossScaleOptimizer`` in ``compile_config`` gives the loss scaling (dynamic, its
``initial_scale`` and ``dynamic_growth_steps``); ``auto_scale_loss`` false means none — as
``Model.compile`` wraps the optimizer in a LossScaleOptimizer under mixed_float16 unless
``auto_scale_loss=False``. A preset (cnn, cnn2) has no policy: fp32 unless ``--precision``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.optim.loss_scale import LossScale

#: Keras' ``LossScaleOptimizer`` defaults, for a model that names none
KERAS_INITIAL_SCALE, KERAS_GROWTH_STEPS = 2.0**15, 2000


@dataclass(frozen=True)
class ModelNumerics:
    """The model's own mixed-precision settings (``keras.compile.numerics``)."""

    policy: str = "float32"
    #: a LossScaleOptimizer's (initial_scale, dynamic_growth_steps), or None
    loss_scale: tuple[float, int] | None = None
    #: tf.keras 2's ``LossScaleOptimizer(dynamic=False)``: a fixed scale
    static: bool = False
    auto_scale_loss: bool = True


@dataclass
class Numerics:
    precision: str
    stochastic_rounding: str
    loss_scale: LossScale

    def describe(self) -> str:
        ls = self.loss_scale
        scaling = "no loss scaling" if not ls.active else f"{ls.mode} loss scale {ls.scale:g}"
        if ls.dynamic:
            scaling += f" (x2 after {ls.growth_steps} clean steps, /2 and skip on inf/nan)"
        sr = f", stochastic rounding {self.stochastic_rounding}" if self.precision == "fp16" else ""
        master = " (float32 master weights on the host)" if self.precision == "fp16" else ""
        return f"precision {self.precision}{master}, {scaling}{sr}"

    def record(self) -> dict:
        return {
            "precision": self.precision,
            "stochastic_rounding": self.stochastic_rounding,
            "loss_scale": self.loss_scale.record(),
        }


def for_run(cfg, model) -> Numerics:
    """The run's numerics: ``cfg`` (a ``TrainerConfig``) over ``model``'s :class:`ModelNumerics`."""
    own = model.numerics or ModelNumerics()
    precision = cfg.precision or ("fp16" if own.policy == "mixed_float16" else "fp32")
    initial, growth = own.loss_scale or (KERAS_INITIAL_SCALE, KERAS_GROWTH_STEPS)
    if cfg.initial_loss_scale is not None:  # given: the flag wins over the model's
        initial = cfg.initial_loss_scale
    if cfg.loss_scale_growth_steps is not None:
        growth = cfg.loss_scale_growth_steps
    mode = cfg.loss_scaling
    if mode is None:
        if own.loss_scale is not None:
            mode = "static" if own.static else "dynamic"
        else:
            mode = "dynamic" if precision == "fp16" and own.auto_scale_loss else "off"
    scale = LossScale(mode, float(initial), int(growth))
    return Numerics(precision, cfg.stochastic_rounding, scale)


class NumericsMetrics:
    """``ringtrain_ipu_*`` gauges of what each IPU computes in (``ipu`` label: the replica),
    registered on the trainer's metrics registry: accumulation, precision, loss scale."""

    def __init__(self, registry, replicas: int, accumulation: int, numerics: Numerics):
        ipus = [str(i) for i in range(replicas)]
        acc = Gauge(
            "ringtrain_ipu_gradient_accumulation_steps",
            "Micro-batches per optimizer step",
            ["ipu"],
            registry=registry,
        )
        info = Gauge(
            "ringtrain_ipu_precision_info",
            "1, labelled with what the IPU's forward and backward compute in (fp16, fp32) "
            "and its stochastic rounding",
            ["ipu", "precision", "stochastic_rounding"],
            registry=registry,
        )
        scale = Gauge("ringtrain_ipu_loss_scale", "The loss scale now", ["ipu"], registry=registry)
        self._skipped = Counter(
            "ringtrain_ipu_skipped_steps",
            "Steps skipped for a non-finite gradient (dynamic loss scaling)",
            registry=registry,
        )
        self._scale = [scale.labels(ipu=i) for i in ipus]
        for i in ipus:
            acc.labels(ipu=i).set(accumulation)
            info.labels(i, numerics.precision, numerics.stochastic_rounding).set(1)
        self.observe(numerics.loss_scale, 0)

    def observe(self, loss_scale: LossScale, skipped: int) -> None:
        for g in self._scale:
            g.set(loss_scale.scale)
        if skipped:
            self._skipped.inc(skipped)


def wire_half(cfg, run: Numerics) -> bool:
    """Whether the ring reduces float16 gradients: ``--allreduce-dtype``, by default float16
    under fp16 on the ring. Open MPI has no standard float16 type: refused there."""
    want = cfg.allreduce_dtype or ("float16" if run.precision == "fp16" else "float32")
    if want == "float16" and cfg.collective != "ring":
        if cfg.allreduce_dtype:
            raise InvalidSpec("--allreduce-dtype float16 needs --collective ring (MPI has none)")
        return False
    return want == "float16"
