"""``compile_config`` → the loss, optimizer and metrics that run, through their registries.

The loss registry is ``engine.losses`` (training and evaluation alike), the optimizer and
schedule registry ``optim.registry``; this module only reads the Keras fields, refuses by field
what ringtrain would otherwise ignore, and folds a final softmax/sigmoid into the loss.
"""

from __future__ import annotations

from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import keras_metrics, losses
from ringtrain_trainer.keras.entry import snake_case
from ringtrain_trainer.numerics import ModelNumerics
from ringtrain_trainer.optim.registry import OptimizerSpec, from_compile_config

#: compile_config fields that only steer Keras' own loop (how many steps per call, eager or
#: XLA): they change no number ringtrain computes, so any value is accepted; auto_scale_loss
#: is read by :func:`numerics`
COMPILE_EXECUTION = ("run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss")
#: metrics ringtrain reports itself, per kind of loss (loss and the metric on /status,
#: TensorBoard, the evaluator): accuracy for classification, MAE for regression
METRICS = {
    "sparse": ("accuracy", "acc", "sparse_categorical_accuracy"),
    "categorical": ("accuracy", "acc", "categorical_accuracy"),
    "binary": ("accuracy", "acc", "binary_accuracy"),
    "regression": ("mae", "mean_absolute_error"),
}


def _check(comp: dict, kind: str) -> None:
    """Refuse, by field, compile settings ringtrain would otherwise ignore."""
    for k, v in comp.items():
        where = f"model: compile_config.{k}"
        if k in ("optimizer", "loss", *COMPILE_EXECUTION):
            continue
        if k in ("loss_weights", "weighted_metrics"):
            if v not in (None, [], {}):
                raise InvalidSpec(f"{where}={v!r} is not supported (supported: None)")
        elif k == "metrics":
            compiled_metrics(v, kind)
        else:
            raise InvalidSpec(f"{where}: this compile setting is not supported")


def compiled_metrics(v: Any, kind: str) -> tuple[keras_metrics.MetricSpec, ...]:
    """``compile_config.metrics`` beyond the loss's own metric (``METRICS``): each an entry
    of the metric registry (``engine.keras_metrics``), refused by name otherwise."""
    out = []
    for m in v if isinstance(v, list) else [] if v is None else [v]:
        name = m.get("class_name") if isinstance(m, dict) else m
        if name == "function" and isinstance(m, dict):
            name = m.get("config")
        if snake_case(str(name)) in METRICS[kind]:
            continue
        if not keras_metrics.known(name):
            raise InvalidSpec(
                f"model: compile_config.metrics: metric {name!r} is not supported with a {kind} "
                f"loss (ringtrain reports the loss and: {', '.join(METRICS[kind])}, "
                f"{', '.join(keras_metrics.SUPPORTED)})"
            )
        out.append(keras_metrics.parse(m, kind))
    return tuple(out)


def _policy(layers: Any) -> str:
    """``mixed_float16`` when any layer runs under that dtype policy (a final float32
    layer, as Keras' guide advises for the softmax, is computed in float16 all the same and
    its output rounded: the loss itself is float32, as Keras computes it)."""
    for layer in layers if isinstance(layers, list) else []:
        dtype = (layer.get("config") or {}).get("dtype") if isinstance(layer, dict) else None
        if isinstance(dtype, dict):
            dtype = (dtype.get("config") or {}).get("name")
        if dtype == "mixed_float16":
            return dtype
    return "float32"


def _unwrap_loss_scale(comp: dict) -> tuple[dict, tuple[float, int] | None, bool]:
    """A ``LossScaleOptimizer`` (Keras 3, or tf.keras 2 with ``dynamic``) becomes its inner
    optimizer plus (initial scale, growth steps) and whether it is static."""
    doc = comp.get("optimizer")
    if not isinstance(doc, dict) or doc.get("class_name") != "LossScaleOptimizer":
        return comp, None, False
    cfg = dict(doc.get("config") or {})
    where = "model: compile_config.optimizer.config"
    inner = cfg.pop("inner_optimizer", None)
    if inner is None:
        raise InvalidSpec(f"{where}: a LossScaleOptimizer without inner_optimizer")
    initial = float(cfg.pop("initial_scale", 2.0**15))
    growth = int(cfg.pop("dynamic_growth_steps", 2000))
    static = cfg.pop("dynamic", True) is False
    cfg.pop("name", None)
    for k, v in cfg.items():
        if v not in (None, False):
            raise InvalidSpec(f"{where}.{k}={v!r} is not supported by ringtrain's loss scaling")
    return {**comp, "optimizer": inner}, (initial, growth), static


def wrap_loss_scale(optimizer: Any, own: ModelNumerics) -> Any:
    """The inverse of :func:`_unwrap_loss_scale` for an export: the optimizer that ran (a
    Keras serialization) back inside the source's LossScaleOptimizer, with the source's
    initial scale and growth steps (Keras 3 has no static scale: that one stays unwrapped)."""
    if own.loss_scale is None or own.static or not isinstance(optimizer, dict):
        return optimizer
    initial, growth = own.loss_scale
    return {
        "module": "keras.optimizers",
        "class_name": "LossScaleOptimizer",
        "config": {
            "name": "loss_scale_optimizer",
            "inner_optimizer": optimizer,
            "initial_scale": initial,
            "dynamic_growth_steps": growth,
        },
        "registered_name": None,
    }


def numerics(model: dict) -> ModelNumerics:
    """The model's mixed-precision settings: its layers' dtype policy, a LossScaleOptimizer
    in ``compile_config`` and ``auto_scale_loss`` (``ringtrain_trainer.numerics``)."""
    comp = model.get("compile_config") or {}
    _, scale, static = _unwrap_loss_scale(comp)
    policy = _policy((model.get("config") or {}).get("layers"))
    auto = comp.get("auto_scale_loss", True) is not False
    return ModelNumerics(policy, scale, static=static, auto_scale_loss=auto)


def read(comp: dict | None, tail: str | None) -> tuple[losses.LossSpec, OptimizerSpec | None]:
    """The loss that runs (``tail``: the model's last activation, folded into it where it is
    the loss's own) and the compiled optimizer (None: the model has none)."""
    comp, _, _ = _unwrap_loss_scale(comp or {})
    loss = losses.parse(comp.get("loss"))
    if loss is None:  # no compile settings: sparse cross-entropy on what the model ends in
        loss = losses.LossSpec("SparseCategoricalCrossentropy", {"from_logits": tail != "softmax"})
    _check(comp, loss.kind)
    return losses.fold(loss, tail), from_compile_config(comp)
