"""Keras' per-example regression and margin losses, value and gradient side by side.

Pipeline position: entries of the loss registry (``engine.losses``) whose kind is
``regression`` beyond MSE/MAE/Huber: ``poisson``, ``log_cosh``, ``kl_divergence``,
``mean_squared_logarithmic_error``, ``mean_absolute_percentage_error``, ``hinge``,
``squared_hinge``, ``categorical_hinge`` and ``cosine_similarity``. Each function reads the
model's output ``z`` and the labels ``y`` (rows, last axis ``k``), writes into ``d`` the gradient
of the *summed* per-example loss with respect to ``z`` and returns that sum; the caller divides
both by the batch size (Keras' ``sum_over_batch_size``). Everything runs in place in a
:class:`Work` allocated once per program, so a training step allocates nothing.

The formulas, clipping epsilons and the branch each gradient takes at a tie are Keras 3's
(``keras/src/losses/losses.py``, TensorFlow backend): ``epsilon`` is ``backend.epsilon()``
(1e-7); ``maximum``/``minimum``/``clip`` pass the gradient where the kept argument is the
variable one, ties included, as TensorFlow's gradients do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

EPS = 1e-7  # keras.backend.epsilon()
LOG2 = math.log(2.0)


class Work:
    """Scratch for one batch of ``rows`` x ``k``: two float blocks, a mask, three row
    vectors and a row mask (:func:`nbytes` counts them for the memory plan)."""

    def __init__(self, rows: int, k: int, dtype=np.float32):
        self.a = np.zeros((rows, k), dtype)
        self.b = np.zeros((rows, k), dtype)
        self.m = np.zeros((rows, k), np.bool_)
        self.r1 = np.zeros(rows, dtype)
        self.r2 = np.zeros(rows, dtype)
        self.idx = np.zeros(rows, np.int64)
        self.mb = np.zeros(rows, np.bool_)
        self.rows = np.arange(rows)


def nbytes(rows: int, k: int, itemsize: int = 4) -> int:
    """What one :class:`Work` allocates."""
    return rows * k * (2 * itemsize + 1) + rows * (2 * itemsize + 17)


def poisson(z, y, d, w: Work) -> float:
    """``mean(z - y * log(z + eps))``."""
    k = z.shape[1]
    np.add(z, EPS, out=w.a)
    np.divide(y, w.a, out=d)
    np.subtract(1, d, out=d)
    np.multiply(d, 1.0 / k, out=d)
    np.log(w.a, out=w.a)
    np.multiply(w.a, y, out=w.a)
    np.subtract(z, w.a, out=w.a)
    return float(w.a.sum()) / k


def log_cosh(z, y, d, w: Work) -> float:
    """``mean(e + softplus(-2e) - log 2)`` with ``e = z - y`` (= ``|e| + log1p(exp(-2|e|))
    - log 2``); its gradient is ``tanh(e)``."""
    k = z.shape[1]
    a, b = w.a, w.b
    np.subtract(z, y, out=a)
    np.tanh(a, out=d)
    np.multiply(d, 1.0 / k, out=d)
    np.abs(a, out=a)
    np.multiply(a, -2.0, out=b)
    np.exp(b, out=b)
    np.log1p(b, out=b)
    np.add(a, b, out=a)
    return (float(a.sum()) - LOG2 * a.size) / k


def kl_divergence(z, y, d, w: Work) -> float:
    """``sum(yc * log(yc / zc))``, both clipped to ``[eps, 1]`` (a sum over the last axis, not
    a mean); no gradient where ``z`` was clipped."""
    a, b = w.a, w.b
    np.clip(y, EPS, 1, out=a)
    np.clip(z, EPS, 1, out=b)
    np.equal(b, z, out=w.m)
    np.divide(a, b, out=d)
    np.log(d, out=b)
    np.multiply(b, a, out=b)
    np.negative(d, out=d)
    np.multiply(d, w.m, out=d)
    return float(b.sum())


def mean_squared_logarithmic_error(z, y, d, w: Work) -> float:
    """``mean((log(max(z, eps) + 1) - log(max(y, eps) + 1))**2)``."""
    k = z.shape[1]
    a, b = w.a, w.b
    np.maximum(y, EPS, out=b)
    np.add(b, 1, out=b)
    np.log(b, out=b)
    np.maximum(z, EPS, out=a)
    np.add(a, 1, out=a)
    np.copyto(d, a)
    np.log(a, out=a)
    np.subtract(a, b, out=a)
    np.divide(a, d, out=d)
    np.multiply(d, 2.0 / k, out=d)
    np.greater_equal(z, EPS, out=w.m)
    np.multiply(d, w.m, out=d)
    np.multiply(a, a, out=a)
    return float(a.sum()) / k


def mean_absolute_percentage_error(z, y, d, w: Work) -> float:
    """``100 * mean(|y - z| / max(|y|, eps))``."""
    k = z.shape[1]
    a, b = w.a, w.b
    np.abs(y, out=b)
    np.maximum(b, EPS, out=b)
    np.subtract(z, y, out=a)
    np.sign(a, out=d)
    np.divide(d, b, out=d)
    np.multiply(d, 100.0 / k, out=d)
    np.abs(a, out=a)
    np.divide(a, b, out=a)
    return 100.0 * float(a.sum()) / k


def _hinge_labels(y, w: Work) -> np.ndarray:
    """Keras' ``convert_binary_labels_to_hinge``: 0/1 labels become -1/1 when *every* label of
    the batch is 0 or 1, as Keras decides per batch; into ``w.b``."""
    b = w.b
    np.multiply(y, y, out=b)
    np.subtract(b, y, out=b)  # 0 exactly where y is 0 or 1
    if not b.any():
        np.multiply(y, 2.0, out=b)
        np.subtract(b, 1.0, out=b)
    else:
        np.copyto(b, y)
    return b


def _margin(z, y, w: Work) -> np.ndarray:
    """``max(1 - y' z, 0)`` into ``w.a`` (``y'`` in ``w.b``), ``w.m`` where it passes."""
    yy = _hinge_labels(y, w)
    a = w.a
    np.multiply(yy, z, out=a)
    np.subtract(1.0, a, out=a)
    np.greater_equal(a, 0.0, out=w.m)
    np.maximum(a, 0.0, out=a)
    return a


def hinge(z, y, d, w: Work) -> float:
    """``mean(max(1 - y' z, 0))``."""
    k = z.shape[1]
    a = _margin(z, y, w)
    np.multiply(w.b, w.m, out=d)
    np.multiply(d, -1.0 / k, out=d)
    return float(a.sum()) / k


def squared_hinge(z, y, d, w: Work) -> float:
    """``mean(max(1 - y' z, 0)**2)``."""
    k = z.shape[1]
    a = _margin(z, y, w)
    np.multiply(w.b, a, out=d)
    np.multiply(d, -2.0 / k, out=d)
    np.multiply(a, a, out=a)
    return float(a.sum()) / k


def categorical_hinge(z, y, d, w: Work) -> float:
    """``max(max((1 - y) z) - sum(y z) + 1, 0)`` per example (no mean over the last axis)."""
    a, b = w.a, w.b
    np.subtract(1.0, y, out=b)
    np.multiply(b, z, out=a)
    np.argmax(a, axis=1, out=w.idx)
    np.max(a, axis=1, out=w.r1)  # neg
    np.multiply(y, z, out=a)
    np.sum(a, axis=1, out=w.r2)  # pos
    np.subtract(w.r1, w.r2, out=w.r1)
    np.add(w.r1, 1.0, out=w.r1)
    np.greater_equal(w.r1, 0.0, out=w.mb)
    np.maximum(w.r1, 0.0, out=w.r1)
    # d = (onehot(argmax) * (1 - y) - y) on the rows whose margin passes
    np.negative(y, out=d)
    d[w.rows, w.idx] += b[w.rows, w.idx]
    np.multiply(d, w.mb[:, None], out=d)
    return float(w.r1.sum())


def cosine_similarity(z, y, d, w: Work) -> float:
    """``-sum(l2n(y) * l2n(z))`` with Keras' ``normalize``: ``x * min(rsqrt(sum x**2),
    1/eps)``; the gradient flows through the norm only where it was not clamped."""
    a, b, r1, r2 = w.a, w.b, w.r1, w.r2
    with np.errstate(divide="ignore"):
        np.multiply(y, y, out=a)
        np.sum(a, axis=1, out=r1)
        np.sqrt(r1, out=r1)
        np.divide(1.0, r1, out=r1)
        np.minimum(r1, 1.0 / EPS, out=r1)
        np.multiply(y, r1[:, None], out=b)  # y normalized
        np.multiply(z, z, out=a)
        np.sum(a, axis=1, out=r2)
        np.sqrt(r2, out=r2)
        np.divide(1.0, r2, out=r2)
    np.less_equal(r2, 1.0 / EPS, out=w.mb)
    np.minimum(r2, 1.0 / EPS, out=r2)
    np.multiply(b, z, out=a)
    np.sum(a, axis=1, out=r1)  # yn . z
    value = -float(np.dot(r1, r2))
    np.multiply(b, r2[:, None], out=d)
    np.multiply(r1, r2, out=r1)
    np.multiply(r1, r2, out=r1)
    np.multiply(r1, r2, out=r1)
    np.multiply(r1, w.mb, out=r1)
    np.multiply(z, r1[:, None], out=a)
    np.subtract(a, d, out=d)
    return value


#: Keras class name -> the function
FNS: dict[str, Callable[..., float]] = {
    "Poisson": poisson,
    "LogCosh": log_cosh,
    "KLDivergence": kl_divergence,
    "MeanSquaredLogarithmicError": mean_squared_logarithmic_error,
    "MeanAbsolutePercentageError": mean_absolute_percentage_error,
    "Hinge": hinge,
    "SquaredHinge": squared_hinge,
    "CategoricalHinge": categorical_hinge,
    "CosineSimilarity": cosine_similarity,
}
