"""``compile_config`` → the loss, optimizer and metrics that run, through their registries.

The loss registry is ``engine.loss_spec`` (training and evaluation alike), the optimizer and
schedule registry ``optim.registry``; this module only reads the Keras fields, refuses by field
what ringtrain would otherwise ignore, and folds a final softmax/sigmoid into the loss.
"""

from __future__ import annotations

from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import keras_metrics, loss_spec
from ringtrain_trainer.engine.multiloss import Head, MultiLossSpec
from ringtrain_trainer.keras.entry import snake_case
from ringtrain_trainer.optim.numerics import ModelNumerics
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
            arg = keras_metrics.tuned(m)
            if arg is None:  # the loss's own metric, as Keras computes it
                continue
            if not keras_metrics.known(name):
                raise InvalidSpec(
                    f"model: compile_config.metrics.{name}.{arg}={m['config'][arg]!r} is not "
                    "supported (supported: Keras' default)"
                )
        elif not keras_metrics.known(name):
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
    in ``compile_config`` and ``auto_scale_loss`` (``ringtrain_trainer.optim.numerics``)."""
    comp = model.get("compile_config") or {}
    _, scale, static = _unwrap_loss_scale(comp)
    policy = _policy((model.get("config") or {}).get("layers"))
    auto = comp.get("auto_scale_loss", True) is not False
    return ModelNumerics(policy, scale, static=static, auto_scale_loss=auto)


def read(comp: dict | None, tail: str | None) -> tuple[loss_spec.LossSpec, OptimizerSpec | None]:
    """The loss that runs (``tail``: the model's last activation, folded into it where it is
    the loss's own) and the compiled optimizer (None: the model has none)."""
    comp, _, _ = _unwrap_loss_scale(comp or {})
    loss = loss_spec.parse(comp.get("loss"))
    if loss is None:  # no compile settings: sparse cross-entropy on what the model ends in
        loss = loss_spec.LossSpec(
            "SparseCategoricalCrossentropy", {"from_logits": tail != "softmax"}
        )
    _check(comp, loss.kind)
    return loss_spec.fold(loss, tail), from_compile_config(comp)


def _per_output(v: Any, names: list[str], field: str, default: Any) -> list[Any]:
    """A compile setting given per output, as Keras takes it: a list in output order, a dict
    keyed by output name (a missing name gets ``default``), or None (``default`` for all)."""
    where = f"model: compile_config.{field}"
    if v is None:
        return [default] * len(names)
    if isinstance(v, list):
        if len(v) != len(names):
            raise InvalidSpec(
                f"{where} has {len(v)} entries for the model's {len(names)} outputs "
                f"({', '.join(names)})"
            )
        return list(v)
    if isinstance(v, dict):
        unknown = [k for k in v if k not in names]
        if unknown:
            raise InvalidSpec(
                f"{where} names {unknown}, which are not outputs of the model "
                f"(outputs: {', '.join(names)})"
            )
        return [v.get(n, default) for n in names]
    raise InvalidSpec(f"{where}={v!r} is not supported (a list or a dict by output name)")


def _is_one_loss(v: Any) -> bool:
    """A single loss (a name, or a serialized loss/function) rather than one per output."""
    return isinstance(v, str) or (isinstance(v, dict) and "class_name" in v)


def read_heads(
    comp: dict | None, tails: list[str | None], names: list[str], widths: list[int]
) -> tuple[Any, OptimizerSpec | None]:
    """Several outputs: each output's loss (one loss for all, a list, or a dict by output
    name; None: that output is not trained from), ``loss_weights`` (list or dict) and
    per-output metrics, as a ``engine.multiloss.MultiLossSpec``; and the optimizer."""
    comp, _, _ = _unwrap_loss_scale(comp or {})
    doc = comp.get("loss")
    if doc is None:
        raise InvalidSpec(
            f"model: a model with several outputs ({', '.join(names)}) needs compile(loss=...) "
            "(one loss, a list or a dict by output name)"
        )
    docs = [doc] * len(names) if _is_one_loss(doc) else _per_output(doc, names, "loss", None)
    weights = _per_output(comp.get("loss_weights"), names, "loss_weights", 1.0)
    metrics = comp.get("metrics")
    if (
        isinstance(metrics, list)
        and metrics
        and not all(isinstance(m, list) or m is None for m in metrics)
    ):
        raise InvalidSpec(
            "model: compile_config.metrics: a model with several outputs needs them per "
            "output (a list of lists or a dict by output name), as Keras does"
        )
    per_metrics = _per_output(metrics or None, names, "metrics", None)
    for k, v in comp.items():
        if k in ("optimizer", "loss", "loss_weights", "metrics", *COMPILE_EXECUTION):
            continue
        if k == "weighted_metrics" and v in (None, [], {}):
            continue
        raise InvalidSpec(f"model: compile_config.{k}={v!r}: this compile setting is not supported")
    heads = []
    for name, d, w, ms, tail, width in zip(
        names, docs, weights, per_metrics, tails, widths, strict=True
    ):
        if not isinstance(w, int | float) or isinstance(w, bool) or w < 0:
            raise InvalidSpec(
                f"model: compile_config.loss_weights for output {name!r}={w!r} is not "
                "supported (a number ≥ 0)"
            )
        loss = loss_spec.parse(d)
        ms = [ms] if isinstance(ms, str | dict) else list(ms or [])
        if loss is None:
            if ms:
                raise InvalidSpec(
                    f"model: compile_config.metrics for output {name!r}: an output with "
                    "loss None reports no metric in ringtrain (supported: none)"
                )
            heads.append(Head(name, None, float(w), width))
            continue
        try:
            loss = loss_spec.fold(loss, tail)
        except InvalidSpec as e:
            raise InvalidSpec(f"{e} (output {name!r})") from None
        names_ok = METRICS[loss.kind]
        got = []
        for m in ms:
            mname = snake_case(str(m.get("class_name") if isinstance(m, dict) else m))
            arg = keras_metrics.tuned(m)
            if arg is not None:
                raise InvalidSpec(
                    f"model: compile_config.metrics for output {name!r}: {mname}.{arg}="
                    f"{m['config'][arg]!r} is not supported with several outputs (supported: "
                    "Keras' default)"
                )
            if mname not in names_ok:
                raise InvalidSpec(
                    f"model: compile_config.metrics: metric {mname!r} for output {name!r} is "
                    f"not supported with a {loss.kind} loss (supported: {', '.join(names_ok)})"
                )
            got.append(loss.metric)
        heads.append(Head(name, loss, float(w), width, tuple(got)))
    if not any(h.loss is not None for h in heads):
        raise InvalidSpec("model: compile_config.loss is None for every output: nothing to train")
    return MultiLossSpec(tuple(heads)), from_compile_config(comp)
