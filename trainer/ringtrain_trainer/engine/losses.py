"""The losses that run: each registry entry's (``engine.loss_spec``) value and its gradient with
respect to the model's output side by side, used by training, the worker's evaluation and the
Evaluator.

Pipeline position: ``engine.program.Program`` builds
one :class:`Loss` per compiled program (labels, gradient and workspace allocated once; a training
step allocates nothing) and the evaluators call :meth:`Loss.total` / :meth:`Loss.score` on whole
batches. Numpy only.

A final ``softmax`` (categorical losses) or ``sigmoid`` (binary cross-entropy) is folded into the
loss, as Keras' TensorFlow backend does (its ``_keras_logits``): the program's output is then the
logits and the entry computes the loss from them, stable and exact. Every entry reduces with
``sum_over_batch_size``: the per-example loss (a mean over the output's last axis for the
element-wise losses) summed and divided by the batch size.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine import loss_fns
from ringtrain_trainer.engine.loss_spec import LossSpec


def label_buffer(spec: LossSpec, batch: int, k: int, dtype=np.float32) -> np.ndarray:
    """One batch of labels as the loss reads them: class ids, or rows like the output; one
    row per example either way (``(batch, positions)`` ids or ``(batch, positions * k)``
    values for a per-position loss), so that batches slice by example."""
    p = spec.positions
    if spec.kind == "sparse":
        return np.zeros(batch if p == 1 else (batch, p), np.int64)
    return np.zeros((batch, p * k), dtype)


def buffer_bytes(spec: LossSpec, batch: int, k: int, itemsize: int = 4) -> tuple[int, int]:
    """(labels, workspace) bytes a :class:`Loss` allocates: what the memory plan counts."""
    batch *= spec.positions
    labels = batch * 8 if spec.kind == "sparse" else batch * k * itemsize
    work = (2 * batch * k + 2 * batch) * itemsize  # grad, work, rowtmp, picked
    if spec.kind == "sparse" and spec.arg("ignore_class") is not None:
        work += batch * 9  # valid (bool), safe (int64)
    if spec.kind != "sparse" and spec.arg("label_smoothing"):
        work += batch * k * itemsize  # the smoothed labels
    if spec.name in loss_fns.FNS:
        work += loss_fns.nbytes(batch, k, itemsize)
    return labels, work


class Loss:
    """One program's loss: ``labels`` and ``grad`` (dloss/doutput) allocated once.

    ``step(z)`` is the training path: the mean loss of the batch in ``labels``, the gradient
    written into ``grad`` (already divided by the batch size). ``total`` / ``score`` are the
    evaluation path on any number of examples (float64): the summed loss and the summed
    metric (correct predictions, or absolute error) of those examples.

    A per-position loss (``LossSpec.out_shape``) reads every position of every example as one
    row — ``batch * positions`` rows — through reshaped views of the same buffers: Keras'
    ``sum_over_batch_size`` is then the mean over rows, and an example's evaluation value the
    mean over its positions."""

    def __init__(self, spec: LossSpec, batch: int, k: int, dtype=np.float32):
        self.positions = spec.positions
        self.spec, self.k = spec, k
        self.batch = batch * self.positions  # rows
        self.dtype = np.dtype(dtype)
        self.labels = label_buffer(spec, batch, k, self.dtype)
        self.grad = np.zeros((batch, *(spec.out_shape or (k,))), self.dtype)
        #: the rows the math reads: a view of ``labels`` (and ``_g`` of ``grad``)
        self._y = self.labels.reshape(self.batch, *(() if spec.kind == "sparse" else (k,)))
        batch = self.batch
        self.work = np.zeros((batch, k), self.dtype)
        self.rowtmp = np.zeros((batch, 1), self.dtype)
        self.picked = np.zeros(batch, self.dtype)
        self.arange = np.arange(batch)
        self.ignore = spec.arg("ignore_class") if spec.kind == "sparse" else None
        if self.ignore is not None:
            self.valid = np.zeros(batch, np.bool_)
            self.safe = np.zeros(batch, np.int64)
        ls = spec.arg("label_smoothing") or 0.0
        self.smooth = (1.0 - ls, ls / k if spec.kind == "categorical" else 0.5 * ls)
        self.delta = spec.arg("delta")
        self.smoothed = np.zeros_like(self._g) if self.smooth[1] else None
        self.inv = self.dtype.type(1.0 / batch)
        self.inv_k = self.dtype.type(1.0 / (batch * k))
        self.fn = loss_fns.FNS.get(spec.name)
        self.fn_work = loss_fns.Work(batch, k, self.dtype) if self.fn else None

    @property
    def grad(self) -> np.ndarray:
        """dloss/doutput, shaped like the output (``engine.multiloss`` points it into its
        packed buffer)."""
        return self._grad

    @grad.setter
    def grad(self, buffer: np.ndarray) -> None:
        self._grad, self._g = buffer, buffer.reshape(self.batch, self.k)

    # -- training: preallocated, nothing allocated per step ---------------------------------
    def step(self, z: np.ndarray) -> float:
        kind, name = self.spec.kind, self.spec.name
        z = z.reshape(self.batch, self.k)
        if kind == "sparse":
            return self._sparse(z)
        if kind == "categorical":
            return self._categorical(z)
        if kind == "binary":
            return self._binary(z)
        if self.fn is not None:
            loss = self.fn(z, self._y, self._g, self.fn_work)
            np.multiply(self._g, self.inv, out=self._g)
            return loss / self.batch
        return self._elementwise(z, name)

    def _sparse(self, z: np.ndarray) -> float:
        p, tmp, picked, labels = self.work, self.rowtmp, self.picked, self._y
        if self.ignore is not None:
            np.not_equal(labels, self.ignore, out=self.valid)
            np.multiply(labels, self.valid, out=self.safe)
            labels = self.safe
        np.max(z, axis=1, keepdims=True, out=tmp)
        np.subtract(z, tmp, out=p)
        np.copyto(picked, p[self.arange, labels])
        np.exp(p, out=p)
        np.sum(p, axis=1, keepdims=True, out=tmp)
        np.divide(p, tmp, out=p)
        np.log(tmp, out=tmp)
        d = self._g
        np.copyto(d, p)
        d[self.arange, labels] -= 1
        if self.ignore is not None:
            # Keras masks the ignored rows and divides by the rows that count (none: 0)
            np.subtract(tmp[:, 0], picked, out=picked)
            np.multiply(picked, self.valid, out=picked)
            np.multiply(d, self.valid[:, None], out=d)
            count = int(np.count_nonzero(self.valid))
            np.multiply(d, self.dtype.type(1.0 / max(count, 1)), out=d)
            return float(picked.sum()) / count if count else 0.0
        else:
            loss = (float(tmp.sum()) - float(picked.sum())) / self.batch
        np.multiply(d, self.inv, out=d)
        return loss

    def _smoothed(self) -> np.ndarray:
        """The labels, or the smoothed labels in ``smoothed``."""
        if self.smoothed is None:
            return self._y
        y = self.smoothed
        np.multiply(self._y, self.dtype.type(self.smooth[0]), out=y)
        np.add(y, self.dtype.type(self.smooth[1]), out=y)
        return y

    def _categorical(self, z: np.ndarray) -> float:
        p, tmp, d = self.work, self.rowtmp, self._g
        y = self._smoothed()
        np.max(z, axis=1, keepdims=True, out=tmp)
        np.subtract(z, tmp, out=p)  # z - max
        np.multiply(y, p, out=d)
        picked = float(d.sum())
        np.exp(p, out=p)
        np.sum(p, axis=1, keepdims=True, out=tmp)
        np.divide(p, tmp, out=p)
        np.log(tmp, out=tmp)  # lse - max
        np.multiply(tmp, y, out=d)
        loss = (float(d.sum()) - picked) / self.batch
        np.subtract(p, y, out=d)
        np.multiply(d, self.inv, out=d)
        return loss

    def _binary(self, z: np.ndarray) -> float:
        y, w, d = self._smoothed(), self.work, self._g
        # max(z, 0) - z*y + log1p(exp(-|z|)), as tf.nn.sigmoid_cross_entropy_with_logits
        np.abs(z, out=w)
        np.negative(w, out=w)
        np.exp(w, out=w)
        np.log1p(w, out=w)
        np.multiply(z, y, out=d)
        np.subtract(w, d, out=w)
        np.maximum(z, 0, out=d)
        np.add(w, d, out=w)
        loss = float(w.sum()) / (self.batch * self.k)
        # sigmoid(z) - y
        np.negative(z, out=d)
        np.exp(d, out=d)
        np.add(d, 1, out=d)
        np.reciprocal(d, out=d)
        np.subtract(d, y, out=d)
        np.multiply(d, self.inv_k, out=d)
        return loss

    def _elementwise(self, z: np.ndarray, name: str) -> float:
        e, d = self.work, self._g
        np.subtract(z, self._y, out=e)
        if name == "MeanSquaredError":
            np.multiply(e, e, out=d)
            loss = float(d.sum())
            np.multiply(e, self.dtype.type(2.0) * self.inv_k, out=d)
        elif name == "MeanAbsoluteError":
            np.abs(e, out=d)
            loss = float(d.sum())
            np.sign(e, out=d)
            np.multiply(d, self.inv_k, out=d)
        else:  # Huber
            delta = self.dtype.type(self.delta)
            np.clip(e, -delta, delta, out=d)  # the gradient, before scaling
            # 0.5 c^2 + delta (|e| - |c|) with c = clip(e): both of Keras' branches at once
            loss = float(np.dot(d.ravel(), d.ravel())) * 0.5
            np.abs(e, out=e)
            outside = float(e.sum())
            np.abs(d, out=e)
            loss += float(self.delta) * (outside - float(e.sum()))
            np.multiply(d, self.inv_k, out=d)
        return loss / (self.batch * self.k)

    # -- evaluation: whole examples, float64 -------------------------------------------------
    def rows(self, z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``z`` (the program's output) and ``y`` (labels) of some examples as the loss's rows:
        one per position of each example (the arrays themselves for a flat output)."""
        if self.positions == 1:
            return z, y
        z = z.reshape(-1, self.k)
        return z, y.reshape(len(z), *(() if self.spec.kind == "sparse" else (self.k,)))

    def total(self, z: np.ndarray, y: np.ndarray) -> float:
        """The summed per-example loss of some examples (each the mean over its positions)."""
        return self._total(*self.rows(z, y)) / self.positions

    def score(self, z: np.ndarray, y: np.ndarray) -> float:
        """The summed metric of some examples: correct predictions (Keras' ``accuracy`` for
        this loss: sparse/categorical argmax, binary at 0.5, a row's mean over its outputs), or
        for regression the absolute error (each row's mean over its outputs); per position
        for a per-position loss, each example's the mean over its positions."""
        return self._score(*self.rows(z, y)) / self.positions

    def _total(self, z: np.ndarray, y: np.ndarray) -> float:
        z = np.asarray(z, np.float64)
        kind, name = self.spec.kind, self.spec.name
        if kind == "sparse":
            y = np.asarray(y, np.int64)
            valid = np.ones(len(y), bool) if self.ignore is None else y != self.ignore
            y = np.where(valid, y, 0)
            m = z.max(axis=1)
            lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
            return float(np.sum((lse - z[np.arange(len(y)), y]) * valid))
        y = np.asarray(y, np.float64) * self.smooth[0] + self.smooth[1]
        if self.fn is not None:
            y = y.reshape(z.shape)
            return self.fn(z, y, np.empty_like(z), loss_fns.Work(len(z), z.shape[1], np.float64))
        if kind == "categorical":
            m = z.max(axis=1, keepdims=True)
            lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))
            return float(np.sum(y * (lse - z)))
        if kind == "binary":
            per = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
            return float(per.mean(axis=1).sum())
        e = z - y
        if name == "MeanSquaredError":
            per = e * e
        elif name == "MeanAbsoluteError":
            per = np.abs(e)
        else:
            a = np.abs(e)
            per = np.where(a <= self.delta, 0.5 * e * e, self.delta * a - 0.5 * self.delta**2)
        return float(per.mean(axis=1).sum())

    def _score(self, z: np.ndarray, y: np.ndarray) -> float:
        kind = self.spec.kind
        if kind == "sparse":
            return float(np.count_nonzero(np.argmax(z, axis=1) == y))
        if kind == "categorical":
            return float(np.count_nonzero(np.argmax(z, axis=1) == np.argmax(y, axis=1)))
        if kind == "binary":
            # Keras thresholds the model's output at 0.5: sigmoid(z) > 0.5 is z > 0 when folded
            pred = z > (0.0 if self.spec.folded else 0.5)
            # and compares with the label itself, as Keras: a soft target never counts
            return float(np.sum(np.mean(pred == np.asarray(y), axis=1)))
        return float(np.sum(np.mean(np.abs(np.asarray(z, np.float64) - y), axis=1)))
