"""Keras' stateful metrics, one class each: ``update(y_true, y_pred)`` batch by batch, ``result()``
by Keras' formula on the running state, and that state as one float64 vector that replicas
sum (``keras_metrics.MetricSet.merge``).

Apart from ``keras_metrics`` (the registry: names, arguments, which loss's labels each reads,
and the pass over an evaluation set) because these are the numbers: each class is Keras'
``keras/src/metrics/*`` on numpy, float64, with Keras' epsilons and ``divide_no_nan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringtrain_trainer.engine import loss_fns

EPS = loss_fns.EPS


@dataclass(frozen=True)
class MetricSpec:
    """One compiled metric: its registry entry, the name Keras reports it under, and its
    arguments (Keras' defaults filled in)."""

    cls: str
    name: str
    args: dict = field(default_factory=dict)


class Metric:
    """Keras' stateful metric protocol: ``update(y_true, y_pred)``, ``result()``.
    ``width``: the output's last axis (set by the metric set: a per-class state's size)."""

    #: reads class ids ``(n,)`` as its labels, not rows shaped like the output
    ids = False

    def __init__(self, spec: MetricSpec):
        self.spec = spec
        self.width = 1
        #: the batch's logits where the loss folded the output's activation (the metric set
        #: sets them before ``update``): what Keras' backend reads through ``_keras_logits``
        self.logits: np.ndarray | None = None

    def update(self, y: np.ndarray, p: np.ndarray) -> None:
        raise NotImplementedError

    def result(self) -> float | np.ndarray:
        """Keras' result: a number, or one per class (``F1Score(average=None)``)."""
        raise NotImplementedError

    def state(self) -> np.ndarray:
        """The running state as one float64 vector: what replicas sum (``MetricSet.merge``)."""
        raise NotImplementedError

    def set_state(self, v: np.ndarray) -> None:
        raise NotImplementedError


class MeanWrapper(Metric):
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


class MeanSquaredError(MeanWrapper):
    def per_example(self, y, p):
        return np.mean((p - y) ** 2, axis=-1)


class MeanAbsoluteError(MeanWrapper):
    def per_example(self, y, p):
        return np.mean(np.abs(p - y), axis=-1)


class MeanAbsolutePercentageError(MeanWrapper):
    def per_example(self, y, p):
        return 100.0 * np.mean(np.abs((y - p) / np.maximum(np.abs(y), 1e-7)), axis=-1)


class RootMeanSquaredError(MeanWrapper):
    """``sqrt`` of the mean squared error over every element (Keras' ``Mean`` of the squared
    error tensor)."""

    def per_example(self, y, p):
        return ((p - y) ** 2).ravel()

    def result(self):
        return float(np.sqrt(super().result()))


class BinaryAccuracy(MeanWrapper):
    """Keras' ``BinaryAccuracy``: the model's output above ``threshold`` equal to the label,
    the mean over the last axis (0.0 on logits: a model without its sigmoid)."""

    def per_example(self, y, p):
        return np.mean(y == (p > self.spec.args["threshold"]), axis=-1)


class TopKCategoricalAccuracy(MeanWrapper):
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
    sparse = ids = True


class LossValue(MeanWrapper):
    """A loss function of ``engine.loss_fns`` as a metric (``LogCoshError`` is ``LogCosh``):
    the mean over examples of its per-example value; ``CosineSimilarity`` the metric is the
    similarity itself, the loss its negative."""

    def update(self, y, p):
        y, p = np.asarray(y, np.float64), np.asarray(p, np.float64)
        rows = p.reshape(len(p), -1) if p.ndim > 1 else p[:, None]
        y = y.reshape(rows.shape)
        fn = loss_fns.FNS["LogCosh" if self.spec.cls == "LogCoshError" else self.spec.cls]
        w = loss_fns.Work(len(rows), rows.shape[1], np.float64)
        v = fn(rows, y, np.empty_like(rows), w)
        self.total += -v if self.spec.cls == "CosineSimilarity" else v
        self.count += len(rows)


class BinaryCrossentropy(MeanWrapper):
    """Keras' ``binary_crossentropy`` on the probabilities (clipped to [eps, 1 - eps]) or,
    ``from_logits``, on logits; ``label_smoothing`` toward 0.5."""

    def per_example(self, y, p):
        a = self.spec.args
        y = y * (1.0 - a["label_smoothing"]) + 0.5 * a["label_smoothing"]
        z = p if a["from_logits"] else self.logits
        if z is not None:
            per = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
        else:  # the TensorFlow backend's, in float32: clipped to [eps, 1 - eps]
            q = np.clip(p.astype(np.float32), np.float32(EPS), np.float32(1 - EPS))
            per = -(y * np.log(q) + (1 - y) * np.log(1 - q))
        return np.mean(per, axis=-1)


def _log_probs(p: np.ndarray, from_logits: bool) -> np.ndarray:
    """Keras' categorical cross-entropies' log-probabilities: a log-softmax of logits, or the
    output normalized to sum 1 and clipped to [eps, 1 - eps]."""
    if from_logits:
        m = p.max(axis=-1, keepdims=True)
        return p - m - np.log(np.exp(p - m).sum(axis=-1, keepdims=True))
    q = np.clip(p / p.sum(axis=-1, keepdims=True), EPS, 1 - EPS)
    return np.log(q)


class CategoricalCrossentropy(MeanWrapper):
    def per_example(self, y, p):
        a = self.spec.args
        k = p.shape[-1]
        y = y * (1.0 - a["label_smoothing"]) + a["label_smoothing"] / k
        z = p if a["from_logits"] else self.logits
        return -np.sum(y * (_log_probs(p, False) if z is None else _log_probs(z, True)), axis=-1)


class SparseCategoricalCrossentropy(MeanWrapper):
    """The TensorFlow backend's: on probabilities, the clipped output's log is read as logits
    (so the result is renormalized over the clipped values)."""

    ids = True

    def per_example(self, y, p):
        ids = np.asarray(y).reshape(len(p)).astype(np.int64)
        z = p if self.spec.args["from_logits"] else self.logits
        logp = _log_probs(_log_probs(p, False), True) if z is None else _log_probs(z, True)
        return -logp[np.arange(len(p)), ids]


# -- counts at a threshold ---------------------------------------------------------------------
class FBetaScore(Metric):
    """Keras' ``FBetaScore``/``F1Score`` on ``(n, classes)`` labels: per class the true
    positives, false positives and false negatives of the thresholded output (the row's
    maximum when ``threshold`` is None), then F-beta averaged ``micro``, ``macro`` or
    ``weighted`` by each class's support; ``average=None``: one per class (a vector)."""

    def __init__(self, spec: MetricSpec):
        super().__init__(spec)
        self.counts: np.ndarray | None = None  # tp, fp, fn, support per class

    def update(self, y, p):
        y = np.asarray(y, np.float64).reshape(len(p), -1)
        p = np.asarray(p, np.float64).reshape(y.shape)
        t = self.spec.args["threshold"]
        # None: the row's maximum, but never an all-zero row's every class
        top = (p >= p.max(axis=-1, keepdims=True)) & (np.abs(p) > 1e-9)
        pred = (top if t is None else p > t).astype(np.float64)
        c = np.stack([pred * y, pred * (1 - y), (1 - pred) * y, y]).sum(axis=1)
        self.counts = c if self.counts is None else self.counts + c

    def result(self):
        tp, fp, fn, support = self.state().reshape(4, -1)
        avg, b2 = self.spec.args["average"], float(self.spec.args.get("beta", 1.0)) ** 2
        if avg == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        precision = tp / (tp + fp + EPS)
        recall = tp / (tp + fn + EPS)
        f = precision * recall / (b2 * precision + recall + EPS) * (1 + b2)
        if avg == "weighted":
            return float(np.sum(f * support / (support.sum() + EPS)))
        return float(np.mean(f)) if avg else f

    def state(self):
        return np.zeros(4 * self.width) if self.counts is None else self.counts.ravel()

    def set_state(self, v):
        self.counts = np.asarray(v, np.float64).reshape(4, -1)


class R2Score(Metric):
    """Keras' ``R2Score`` (``uniform_average`` or ``variance_weighted_average`` over outputs,
    ``num_regressors`` 0): per output the sums of y, y², (y - p)² and the count."""

    def __init__(self, spec: MetricSpec):
        super().__init__(spec)
        self.sums: np.ndarray | None = None

    def update(self, y, p):
        y = np.asarray(y, np.float64).reshape(len(p), -1)
        p = np.asarray(p, np.float64).reshape(y.shape)
        s = np.stack([y.sum(0), (y * y).sum(0), ((y - p) ** 2).sum(0), np.full(y.shape[1], len(y))])
        self.sums = s if self.sums is None else self.sums + s

    def result(self):
        sy, syy, res, n = self.state().reshape(4, -1)
        with np.errstate(divide="ignore", invalid="ignore"):
            total = syy - sy * (sy / n)
            r2 = 1.0 - res / total
        r2[np.isinf(r2)] = 0.0  # Keras': a constant target with any error scores 0
        agg = self.spec.args["class_aggregation"]
        if agg == "variance_weighted_average":
            return float(np.sum(total * r2) / np.sum(total))
        return float(np.mean(r2)) if agg else r2

    def state(self):
        return np.zeros(4 * self.width) if self.sums is None else self.sums.ravel()

    def set_state(self, v):
        self.sums = np.asarray(v, np.float64).reshape(4, -1)


class MeanIoU(Metric):
    """Keras' ``MeanIoU``: a confusion matrix over ``num_classes`` (labels class ids, or
    one-hot where ``sparse_y_true`` is False; predictions the output's argmax where
    ``sparse_y_pred`` is False), IoU per class that occurs, their mean; the ignored class and
    ids outside ``num_classes`` are left out, as Keras 3."""

    def __init__(self, spec: MetricSpec):
        super().__init__(spec)
        n = int(spec.args["num_classes"])
        self.cm = np.zeros((n, n))

    @property
    def ids(self) -> bool:  # type: ignore[override]
        return bool(self.spec.args["sparse_y_true"])

    def update(self, y, p):
        a = self.spec.args
        y = np.asarray(y)
        t = (y.argmax(-1) if not a["sparse_y_true"] else y).reshape(-1).astype(np.int64)
        q = (np.asarray(p).argmax(-1) if not a["sparse_y_pred"] else p).reshape(-1)
        q = q.astype(np.int64)
        n = len(self.cm)
        # Keras 3 weighs out of range ids and the ignored class 0: they count nowhere
        keep = (t >= 0) & (t < n) & (q >= 0) & (q < n)
        if a["ignore_class"] is not None:
            keep &= t != a["ignore_class"]
        t, q = t[keep], q[keep]
        self.cm += np.bincount(t * n + q, minlength=n * n).reshape(n, n)

    def result(self):
        tp = np.diag(self.cm)
        denominator = self.cm.sum(0) + self.cm.sum(1) - tp
        valid = np.count_nonzero(denominator > 1e-9)
        return float(np.sum(tp / (denominator + EPS)) / (valid + EPS))

    def state(self):
        return self.cm.ravel()

    def set_state(self, v):
        self.cm[:] = np.asarray(v, np.float64).reshape(self.cm.shape)
