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

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import metric_classes as C
from ringtrain_trainer.engine import metric_confusion as CC
from ringtrain_trainer.engine.metric_classes import MetricSpec
from ringtrain_trainer.engine.ranges import COUNT, FINITE, POSITIVE, UNIT, Range

WHERE = "compile_config.metrics"


#: Keras class name -> (implementation, string aliases, accepted arguments and their defaults,
#: the loss kinds whose labels it reads)
_CONFUSION_KINDS = ("binary", "categorical", "regression")
_ANY = ("regression", "binary", "categorical")
_LOSS_VALUES = {
    "LogCoshError": ("logcosh", "log_cosh", "log_cosh_error"),
    "KLDivergence": ("kl_divergence", "kld", "kullback_leibler_divergence"),
    "MeanSquaredLogarithmicError": ("mean_squared_logarithmic_error", "msle"),
    "Poisson": ("poisson",),
    "CosineSimilarity": ("cosine_similarity",),
    "Hinge": ("hinge",),
    "SquaredHinge": ("squared_hinge",),
    "CategoricalHinge": ("categorical_hinge",),
}
_COUNTS = ("TruePositives", "FalsePositives", "TrueNegatives", "FalseNegatives")
_FBETA = {"average": None, "threshold": None}
ENTRIES: dict[str, tuple[type[C.Metric], tuple[str, ...], dict, tuple[str, ...]]] = {
    "AUC": (
        CC.AUC,
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
        CC.Precision,
        ("precision",),
        {"thresholds": None, "top_k": None, "class_id": None},
        _CONFUSION_KINDS,
    ),
    "Recall": (
        CC.Recall,
        ("recall",),
        {"thresholds": None, "top_k": None, "class_id": None},
        _CONFUSION_KINDS,
    ),
    # only where its threshold is not 0.5: the loss's own accuracy is that one (keras.compile)
    "BinaryAccuracy": (
        C.BinaryAccuracy,
        ("binary_accuracy",),
        {"threshold": 0.5},
        ("binary", "regression", "categorical"),
    ),
    "TopKCategoricalAccuracy": (
        C.TopKCategoricalAccuracy,
        ("top_k_categorical_accuracy",),
        {"k": 5},
        ("categorical",),
    ),
    "SparseTopKCategoricalAccuracy": (
        C.SparseTopKCategoricalAccuracy,
        ("sparse_top_k_categorical_accuracy",),
        {"k": 5, "from_sorted_ids": False},
        ("sparse",),
    ),
    "RootMeanSquaredError": (
        C.RootMeanSquaredError,
        ("root_mean_squared_error",),
        {},
        ("regression", "binary", "categorical"),
    ),
    "MeanSquaredError": (
        C.MeanSquaredError,
        ("mean_squared_error", "mse"),
        {},
        ("regression", "binary", "categorical"),
    ),
    "MeanAbsoluteError": (  # a regression loss reports it as its own metric
        C.MeanAbsoluteError,
        ("mean_absolute_error", "mae"),
        {},
        ("binary", "categorical"),
    ),
    "MeanAbsolutePercentageError": (
        C.MeanAbsolutePercentageError,
        ("mean_absolute_percentage_error", "mape"),
        {},
        ("regression", "binary", "categorical"),
    ),
    **{cls: (C.LossValue, aliases, {"axis": -1} if cls == "CosineSimilarity" else {}, _ANY)
       for cls, aliases in _LOSS_VALUES.items()},
    "BinaryCrossentropy": (
        C.BinaryCrossentropy,
        ("binary_crossentropy",),
        {"from_logits": False, "label_smoothing": 0},
        ("binary", "regression"),
    ),
    "CategoricalCrossentropy": (
        C.CategoricalCrossentropy,
        ("categorical_crossentropy",),
        {"from_logits": False, "label_smoothing": 0, "axis": -1},
        ("categorical",),
    ),
    "SparseCategoricalCrossentropy": (
        C.SparseCategoricalCrossentropy,
        ("sparse_categorical_crossentropy",),
        {"from_logits": False, "ignore_class": None, "axis": -1},
        ("sparse",),
    ),
    **{cls: (CC.Count, (), {"thresholds": None}, _CONFUSION_KINDS) for cls in _COUNTS},
    "F1Score": (C.FBetaScore, (), _FBETA, ("binary", "categorical")),
    "FBetaScore": (C.FBetaScore, (), {**_FBETA, "beta": 1.0}, ("binary", "categorical")),
    "R2Score": (
        C.R2Score,
        (),
        {"class_aggregation": "uniform_average", "num_regressors": 0},
        ("regression",),
    ),
    "MeanIoU": (
        C.MeanIoU,
        (),
        {"num_classes": None, "ignore_class": None, "sparse_y_true": True,
         "sparse_y_pred": True, "axis": -1},
        ("sparse", "categorical"),
    ),
}  # fmt: skip
SUPPORTED = tuple(ENTRIES)
_ALIASES = {a: cls for cls, (_, aliases, _, _) in ENTRIES.items() for a in aliases}
#: the arguments supported only at their default (what is not implemented)
_ONLY_DEFAULT = {
    "AUC": ("summation_method", "multi_label", "num_labels", "label_weights"),
    "Precision": ("thresholds", "top_k", "class_id"),
    "Recall": ("thresholds", "top_k", "class_id"),
    "SparseTopKCategoricalAccuracy": ("from_sorted_ids",),
    "CosineSimilarity": ("axis",),
    "CategoricalCrossentropy": ("axis",),
    "SparseCategoricalCrossentropy": ("axis", "ignore_class"),
    "R2Score": ("num_regressors",),
    "MeanIoU": ("axis",),
    **dict.fromkeys(_COUNTS, ("thresholds",)),
}


def _snake(name: str) -> str:
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


#: the meaningful range of a numeric argument, whichever metric takes it (``engine.ranges``)
_RANGES = {"num_thresholds": Range(2, integer=True), "k": COUNT, "label_smoothing": UNIT,
           "beta": POSITIVE, "num_regressors": Range(0, integer=True)}  # fmt: skip
#: ``threshold``: any number on BinaryAccuracy's output (0.0 on logits); F-scores' in (0, 1]
_THRESHOLD = {"BinaryAccuracy": FINITE, "F1Score": Range(0.0, 1.0, lo_open=True)}
_THRESHOLD["FBetaScore"] = _THRESHOLD["F1Score"]
_FLAGS = ("from_logits", "multi_label", "sparse_y_true", "sparse_y_pred")


def _check_ranges(cls: str, args: dict) -> None:
    """Refuse, naming the metric and the argument, a value outside its meaningful range."""
    for k, v in args.items():
        r = _THRESHOLD.get(cls) if k == "threshold" else _RANGES.get(k)
        if k in ("ignore_class", "num_classes") and v is not None:
            r = Range(0, integer=True) if k == "ignore_class" else Range(2, integer=True)
        if r is not None and v is not None and r.fails(v):
            raise InvalidSpec(
                f"model: {WHERE}.{cls}.{k}={v!r} is not supported (supported: {r.text})"
            )
        if k in _FLAGS and not isinstance(v, bool):
            raise InvalidSpec(
                f"model: {WHERE}.{cls}.{k}={v!r} is not supported (supported: a bool)"
            )


def tuned(doc) -> str | None:
    """The first argument of ``doc`` (a ``compile_config.metrics`` entry) that is not its
    registry default, or None: a ``BinaryAccuracy(threshold=0.0)`` is not the loss's own
    accuracy at 0.5 (``keras.compile``)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        return None
    entry = ENTRIES.get(str(doc.get("class_name")))
    defaults = entry[2] if entry else {}
    for k, v in doc["config"].items():
        if k not in ("name", "dtype") and (k not in defaults or v != defaults[k]):
            return k
    return None


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
    cls: str | None  # the Keras class name; None where a serialization names none
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
    _check_ranges(cls, args)
    if cls == "AUC" and args["curve"] not in ("ROC", "PR"):
        raise InvalidSpec(
            f"model: {WHERE}.AUC.curve={args['curve']!r} is not supported (supported: 'ROC' "
            "or 'PR')"
        )
    if cls in ("F1Score", "FBetaScore") and args["average"] not in (
        None,
        "micro",
        "macro",
        "weighted",
    ):
        raise InvalidSpec(
            f"model: {WHERE}.{cls}.average={args['average']!r} is not supported (supported: "
            "None, 'micro', 'macro' or 'weighted')"
        )
    if cls == "R2Score" and args["class_aggregation"] not in (
        None,
        "uniform_average",
        "variance_weighted_average",
    ):
        raise InvalidSpec(
            f"model: {WHERE}.R2Score.class_aggregation={args['class_aggregation']!r} is not "
            "supported (supported: None, 'uniform_average', 'variance_weighted_average')"
        )
    if cls == "MeanIoU" and not (isinstance(args["num_classes"], int) and args["num_classes"] > 1):
        raise InvalidSpec(f"model: {WHERE}.MeanIoU.num_classes: a number of classes is needed")
    if cls == "MeanIoU" and args["sparse_y_pred"] is not False:  # the output is a distribution
        raise InvalidSpec(
            f"model: {WHERE}.MeanIoU.sparse_y_pred={args['sparse_y_pred']!r} is not supported "
            f"with a {kind} loss (supported: False: the model outputs one score per class)"
        )
    if cls == "MeanIoU" and args["sparse_y_true"] is not (kind == "sparse"):
        raise InvalidSpec(
            f"model: {WHERE}.MeanIoU.sparse_y_true={args['sparse_y_true']!r} is not supported "
            f"with a {kind} loss (supported: {kind == 'sparse'}: its labels are "
            f"{'class ids' if kind == 'sparse' else 'one-hot'})"
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
        width: int = 1,
    ):
        self.specs = tuple(specs)
        self.folded = folded
        #: a loss per position: every position of an example is a sample, as in Keras
        self.per_position = per_position
        #: the output's last axis: the size of a per-class state
        self.width = width
        self.reset()

    def reset(self) -> None:
        self.metrics = [ENTRIES[s.cls][0](s) for s in self.specs]
        for m in self.metrics:
            m.width = self.width

    def update(self, z: np.ndarray, y: np.ndarray) -> None:
        if not self.metrics:
            return
        p = logits = np.asarray(z, np.float64)
        if self.folded == "sigmoid":
            p = 1.0 / (1.0 + np.exp(-p))
        elif self.folded == "softmax":
            p = np.exp(p - p.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
        y = np.asarray(y)
        if self.per_position:
            p, logits = p.reshape(-1, p.shape[-1]), logits.reshape(-1, p.shape[-1])
            y = y.reshape(len(p)) if y.size == len(p) else y.reshape(p.shape)
        for m in self.metrics:
            m.logits = logits if self.folded else None
            yy = y if m.ids else y.reshape(p.shape)
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
        """``{name: value}``; a metric with one value per class (``F1Score(average=None)``,
        an array in Keras' logs) as ``name_0``, ``name_1``, ...: every report takes numbers."""
        out: dict[str, float] = {}
        for m in self.metrics:
            r = m.result()
            if np.ndim(r):
                out.update(
                    {f"{m.spec.name}_{i}": round(float(v), 6) for i, v in enumerate(np.asarray(r))}
                )
            else:
                out[m.spec.name] = round(float(r), 6)
        return out


def for_model(spec) -> MetricSet:
    """A fresh pass of a model's compiled metrics (``spec``: a ``keras_model.KerasModel``,
    whose ``config.metrics`` the compile settings gave; none for the presets)."""
    config = spec.config
    positions = getattr(spec.loss, "positions", 1)
    metrics = getattr(config, "metrics", ())
    return MetricSet(metrics, spec.loss.folded, positions > 1, spec.num_classes)
