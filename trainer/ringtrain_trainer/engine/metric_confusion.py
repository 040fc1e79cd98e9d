"""Keras' metrics counted from a confusion of labels and thresholded predictions: AUC (ROC and
PR, Keras' evenly spaced thresholds), Precision, Recall and the four counts.

Apart from ``metric_classes`` because these share one state layout (true and false positives
per threshold, positives and negatives) that replicas sum, and Keras' interpolation rules.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.metric_classes import Metric, MetricSpec


class Confusion(Metric):
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


class AUC(Confusion):
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


class AtHalf(Confusion):
    def __init__(self, spec: MetricSpec):
        super().__init__(spec, 1)

    def _count(self, truth, p):
        above = p > 0.5
        self.tp += np.count_nonzero(above & truth)
        self.fp += np.count_nonzero(above & ~truth)


class Precision(AtHalf):
    def result(self):
        d = self.tp[0] + self.fp[0]
        return float(self.tp[0] / d) if d else 0.0


class Recall(AtHalf):
    def result(self):
        return float(self.tp[0] / self.pos) if self.pos else 0.0


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Keras' ``divide_no_nan``: 0 where the divisor is 0."""
    return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


# -- the losses as metrics: Keras' ``MeanMetricWrapper`` of the loss function -----------------


class Count(AtHalf):
    """``TruePositives`` & co at 0.5 over every output: the count itself."""

    def result(self):
        tp, fp = self.tp[0], self.fp[0]
        return float(
            {
                "TruePositives": tp,
                "FalsePositives": fp,
                "FalseNegatives": self.pos - tp,
                "TrueNegatives": self.neg - fp,
            }[self.spec.cls]
        )
