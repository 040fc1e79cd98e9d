"""The metric registry: Keras metric class name → one entry, computed as Keras' stateful metric
over a whole evaluation set.

Pipeline position: ``keras.compile`` calls :func:`parse` on each of ``compile_config.metrics``
that the loss's own metric (accuracy, MAE: ``keras.compile.METRICS``) does not cover, refusing
what is unsupported by name before anything runs; the evaluators (the chief's
``ipu.IPU.evaluate`` and the Evaluator replica) build one :class:`MetricSet`, ``update`` it
batch by batch with the program's output and the labels, and report ``results()`` beside the
loss (``/status``, TensorBoard, the events). Metrics change no gradient. Numpy only.

The program's output is the logits where the loss folded the model's final activation
(``engine.loss_spec.fold``); Keras' metrics read the model's output, so :meth:`MetricSet.update`
applies that activation first. Each entry keeps Keras' running state (confusion counts per
threshold, sums and counts) in float64 and its ``result`` is Keras' formula on it: AUC with
Keras' 200 evenly spaced thresholds and its bucketing (``ceil(p * (T - 1)) - 1``), ROC or PR
with interpolation (the PR curve by Davis & Goadrich, as Keras), Precision/Recall at 0.5.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ringtrain.errors import InvalidSpec

WHERE = "compile_config.metrics"


@dataclass(frozen=True)
class MetricSpec:
    """One compiled metric: its registry entry, the name Keras reports it under, and its
    arguments (Keras' defaults filled in)."""

    cls: str
    name: str
    args: dict = field(default_factory=dict)


class _Metric:
    """Keras' stateful metric protocol: ``update(y_true, y_pred)``, ``result()``."""

    def __init__(self, spec: MetricSpec):
        self.spec = spec

    def update(self, y: np.ndarray, p: np.ndarray) -> None:
        raise NotImplementedError

    def result(self) -> float:
        raise NotImplementedError

    def state(self) -> np.ndarray:
        """The running state as one float64 vector: what replicas sum (``MetricSet.merge``)."""
        raise NotImplementedError

    def set_state(self, v: np.ndarray) -> None:
        raise NotImplementedError


class _Mean(_Metric):
    """Keras' ``MeanMetricWrapper``: the mean over examples of a per-example value."""

    def __init__(self, spec: MetricSpec):
        super().__init__(spec)
        self.total, self.count = 0.0, 0

    def per_example(self, y: np.ndarray, p: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def update(self, y, p):
        v = self.per_example(y, p)
        self.total += float(v.sum())
        self.count += v.size

    def result(self):
        return self.total / self.count if self.count else 0.0

    def state(self):
        return np.array([self.total, self.count], np.float64)

    def set_state(self, v):
        self.total, self.count = float(v[0]), round(float(v[1]))


class MeanSquaredError(_Mean):
    def per_example(self, y, p):
        return np.mean((p - y) ** 2, axis=-1)


class MeanAbsoluteError(_Mean):
    def per_example(self, y, p):
        return np.mean(np.abs(p - y), axis=-1)


class MeanAbsolutePercentageError(_Mean):
    def per_example(self, y, p):
        return 100.0 * np.mean(np.abs((y - p) / np.maximum(np.abs(y), 1e-7)), axis=-1)


class RootMeanSquaredError(_Mean):
    """``sqrt`` of the mean squared error over every element (Keras' ``Mean`` of the squared
    error tensor)."""

    def per_example(self, y, p):
        return ((p - y) ** 2).ravel()

    def result(self):
        return float(np.sqrt(super().result()))


class TopKCategoricalAccuracy(_Mean):
    """Whether the label's class is among the ``k`` largest outputs (one-hot labels)."""

    sparse = False

    def per_example(self, y, p):
        ids = np.asarray(y).reshape(len(p), -1)[:, 0] if self.sparse else np.argmax(y, axis=-1)
        ids = ids.astype(np.int64)
        k = int(self.spec.args["k"])
        picked = p[np.arange(len(p)), ids]
        # in_top_k: fewer than k outputs strictly larger than the label's
        return (np.sum(p > picked[:, None], axis=-1) < k).astype(np.float64)


class SparseTopKCategoricalAccuracy(TopKCategoricalAccuracy):
    sparse = True


class _Confusion(_Metric):
    """Confusion counts per threshold over every output (``multi_label=False``: flattened)."""

    def __init__(self, spec: MetricSpec, thresholds: int):
        super().__init__(spec)
        self.t = thresholds
        self.tp = np.zeros(thresholds)
        self.fp = np.zeros(thresholds)
        self.pos = 0.0
        self.neg = 0.0

    def update(self, y, p):
        truth = np.asarray(y, np.float64).ravel() != 0
        p = np.asarray(p, np.float64).ravel()
        self.pos += float(truth.sum())
        self.neg += float(truth.size - truth.sum())
        self._count(truth, p)

    def _count(self, truth: np.ndarray, p: np.ndarray) -> None:
        raise NotImplementedError

    def state(self):
        return np.concatenate([self.tp, self.fp, [self.pos, self.neg]])

    def set_state(self, v):
        t = self.t
        self.tp[:], self.fp[:] = v[:t], v[t : 2 * t]
        self.pos, self.neg = float(v[2 * t]), float(v[2 * t + 1])


class AUC(_Confusion):
    def __init__(self, spec: MetricSpec):
        super().__init__(spec, int(spec.args["num_thresholds"]))

    def _count(self, truth, p):
        if self.spec.args["from_logits"]:
            p = 1.0 / (1.0 + np.exp(-p))
        # Keras' evenly-spaced fast path: bucket max(ceil(p (T-1)) - 1, 0) of p in [0, 1]
        b = np.ceil(np.clip(p, 0.0, 1.0) * (self.t - 1)).astype(np.int64) - 1
        np.maximum(b, 0, out=b)
        tp = np.bincount(b[truth], minlength=self.t)[: self.t]
        fp = np.bincount(b[~truth], minlength=self.t)[: self.t]
        self.tp += np.cumsum(tp[::-1])[::-1]
        self.fp += np.cumsum(fp[::-1])[::-1]

    def result(self):
        tp, fp = self.tp, self.fp
        fn, tn = self.pos - tp, self.neg - fp
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.spec.args["curve"] == "PR":
                dtp = tp[:-1] - tp[1:]
                pp = tp + fp
                slope = _div(dtp, np.maximum(pp[:-1] - pp[1:], 0))
                intercept = tp[1:] - slope * pp[1:]
                both = (pp[:-1] > 0) & (pp[1:] > 0)
                ratio = np.where(both, _div(pp[:-1], np.maximum(pp[1:], 0)), 1.0)
                inc = slope * (dtp + intercept * np.log(ratio))
                inc = _div(inc, np.maximum(tp[1:] + fn[1:], 0))
                return float(inc.sum())
            x, y = _div(fp, fp + tn), _div(tp, tp + fn)
        return float(np.sum((x[:-1] - x[1:]) * (y[:-1] + y[1:]) / 2.0))


class _AtHalf(_Confusion):
    def __init__(self, spec: MetricSpec):
        super().__init__(spec, 1)

    def _count(self, truth, p):
        above = p > 0.5
        self.tp += np.count_nonzero(above & truth)
        self.fp += np.count_nonzero(above & ~truth)


class Precision(_AtHalf):
    def result(self):
        d = self.tp[0] + self.fp[0]
        return float(self.tp[0] / d) if d else 0.0


class Recall(_AtHalf):
    def result(self):
        return float(self.tp[0] / self.pos) if self.pos else 0.0


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Keras' ``divide_no_nan``: 0 where the divisor is 0."""
    return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


#: Keras class name -> (implementation, string aliases, accepted arguments and their defaults,
#: the loss kinds whose labels it reads)
_CONFUSION_KINDS = ("binary", "categorical", "regression")
ENTRIES: dict[str, tuple[type[_Metric], tuple[str, ...], dict, tuple[str, ...]]] = {
    "AUC": (
        AUC,
        ("auc",),
        {
            "num_thresholds": 200,
            "curve": "ROC",
            "summation_method": "interpolation",
            "multi_label": False,
            "num_labels": None,
            "label_weights": None,
            "from_logits": False,
        },
        _CONFUSION_KINDS,
    ),
    "Precision": (
        Precision,
        ("precision",),
        {"thresholds": None, "top_k": None, "class_id": None},
        _CONFUSION_KINDS,
    ),
    "Recall": (
        Recall,
        ("recall",),
        {"thresholds": None, "top_k": None, "class_id": None},
        _CONFUSION_KINDS,
    ),
    "TopKCategoricalAccuracy": (
        TopKCategoricalAccuracy,
        ("top_k_categorical_accuracy",),
        {"k": 5},
        ("categorical",),
    ),
    "SparseTopKCategoricalAccuracy": (
        SparseTopKCategoricalAccuracy,
        ("sparse_top_k_categorical_accuracy",),
        {"k": 5, "from_sorted_ids": False},
        ("sparse",),
    ),
    "RootMeanSquaredError": (
        RootMeanSquaredError,
        ("root_mean_squared_error",),
        {},
        ("regression", "binary", "categorical"),
    ),
    "MeanSquaredError": (
        MeanSquaredError,
        ("mean_squared_error", "mse"),
        {},
        ("regression", "binary", "categorical"),
    ),
    "MeanAbsoluteError": (  # a regression loss reports it as its own metric
        MeanAbsoluteError,
        ("mean_absolute_error", "mae"),
        {},
        ("binary", "categorical"),
    ),
    "MeanAbsolutePercentageError": (
        MeanAbsolutePercentageError,
        ("mean_absolute_percentage_error", "mape"),
        {},
        ("regression", "binary", "categorical"),
    ),
}
SUPPORTED = tuple(ENTRIES)
_ALIASES = {a: cls for cls, (_, aliases, _, _) in ENTRIES.items() for a in aliases}
#: the arguments supported only at their default (what is not implemented)
_ONLY_DEFAULT = {
    "AUC": ("summation_method", "multi_label", "num_labels", "label_weights"),
    "Precision": ("thresholds", "top_k", "class_id"),
    "Recall": ("thresholds", "top_k", "class_id"),
    "SparseTopKCategoricalAccuracy": ("from_sorted_ids",),
}


def _snake(name: str) -> str:
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def known(doc) -> bool:
    """Whether ``doc`` (one entry of ``compile_config.metrics``) names a registry entry."""
    name = doc.get("class_name") if isinstance(doc, dict) else doc
    return str(name) in ENTRIES or _snake(str(name)) in _ALIASES


def parse(doc, kind: str) -> MetricSpec:
    """One ``compile_config.metrics`` entry (a string, or Keras' serialization of a metric)
    → :class:`MetricSpec`; refused naming the field where unsupported or where its labels are
    not the loss's (``kind``: ``engine.loss_spec.LossSpec.kind``)."""
    if isinstance(doc, dict) and doc.get("class_name") == "function":
        doc = doc.get("config")
    if isinstance(doc, str):
        cls, cfg, name = _ALIASES.get(_snake(doc)) or doc, {}, doc
    elif isinstance(doc, dict):
        cls, cfg = doc.get("class_name"), dict(doc.get("config") or {})
        name = cfg.get("name") or _snake(str(cls))
    else:
        raise InvalidSpec(f"model: {WHERE}: {doc!r} is not a metric")
    if cls not in ENTRIES:
        cls = _ALIASES.get(_snake(str(cls)), cls)
    if cls not in ENTRIES:
        raise InvalidSpec(
            f"model: {WHERE}: metric {doc!r} is not supported (supported: accuracy, mae and "
            f"{', '.join(SUPPORTED)})"
        )
    _, _, defaults, kinds = ENTRIES[cls]
    if kind not in kinds:
        raise InvalidSpec(
            f"model: {WHERE}: metric {name!r} ({cls}) is not supported with a {kind} loss "
            f"(supported with: {', '.join(kinds)} losses)"
        )
    args = dict(defaults)
    for k, v in cfg.items():
        if k in ("name", "dtype"):
            continue
        if k not in defaults:
            raise InvalidSpec(f"model: {WHERE}.{cls}.{k}: argument not supported")
        if k in _ONLY_DEFAULT.get(cls, ()) and v != defaults[k]:
            raise InvalidSpec(
                f"model: {WHERE}.{cls}.{k}={v!r} is not supported (supported: {defaults[k]!r})"
            )
        args[k] = v
    if cls == "AUC" and (args["curve"] not in ("ROC", "PR") or int(args["num_thresholds"]) < 2):
        raise InvalidSpec(
            f"model: {WHERE}.AUC: curve={args['curve']!r}, num_thresholds="
            f"{args['num_thresholds']!r} is not supported (supported: 'ROC' or 'PR', > 1)"
        )
    return MetricSpec(cls, str(name), args)


class MetricSet:
    """The compiled metrics of one evaluation pass: ``update`` per batch, ``results`` at the
    end (``{name: value}``, Keras' names)."""

    def __init__(
        self,
        specs: tuple[MetricSpec, ...] | list[MetricSpec],
        folded: str | None,
        per_position: bool = False,
    ):
        self.specs = tuple(specs)
        self.folded = folded
        #: a loss per position: every position of an example is a sample, as in Keras
        self.per_position = per_position
        self.reset()

    def reset(self) -> None:
        self.metrics = [ENTRIES[s.cls][0](s) for s in self.specs]

    def update(self, z: np.ndarray, y: np.ndarray) -> None:
        if not self.metrics:
            return
        p = np.asarray(z, np.float64)
        if self.folded == "sigmoid":
            p = 1.0 / (1.0 + np.exp(-p))
        elif self.folded == "softmax":
            p = np.exp(p - p.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
        y = np.asarray(y)
        if self.per_position:
            p = p.reshape(-1, p.shape[-1])
            y = y.reshape(len(p)) if y.size == len(p) else y.reshape(p.shape)
        for m in self.metrics:
            yy = y if isinstance(m, SparseTopKCategoricalAccuracy) else y.reshape(p.shape)
            m.update(yy.astype(np.float64) if yy.dtype.kind != "f" else yy, p)

    def state(self) -> np.ndarray:
        """Every metric's running state, one float64 vector (empty without metrics)."""
        parts = [m.state() for m in self.metrics]
        return np.concatenate(parts) if parts else np.zeros(0)

    def set_state(self, v: np.ndarray) -> None:
        """The state :meth:`state` gave, summed over the replicas that shared the test set:
        the same results as one replica evaluating all of it (sums and counts add)."""
        at = 0
        for m in self.metrics:
            n = m.state().size
            m.set_state(np.asarray(v[at : at + n], np.float64))
            at += n

    def results(self) -> dict[str, float]:
        return {m.spec.name: round(m.result(), 6) for m in self.metrics}


def for_model(spec) -> MetricSet:
    """A fresh pass of a model's compiled metrics (``spec``: a ``keras_model.KerasModel``,
    whose ``config.metrics`` the compile settings gave; none for the presets)."""
    config = getattr(spec, "config", None)
    positions = getattr(spec.loss, "positions", 1)
    return MetricSet(getattr(config, "metrics", ()), spec.loss.folded, positions > 1)
