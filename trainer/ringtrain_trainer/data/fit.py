"""A data set's fit to the model: labels conformed to the loss, examples checked against the input.

Pipeline position: after loading, before the first step (``npz.fit_model``, ``multi.pack``):
every mismatch is refused naming the array, its dtype and shape and what the model expects.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.shards import all_integer
from ringtrain_trainer.data.split import Dataset
from ringtrain_trainer.engine.loss_spec import LossSpec


def check_fits(
    dataset: Dataset,
    input_shape: tuple[int, ...],
    num_classes: int,
    source: str | os.PathLike,
    loss: LossSpec | None = None,
    input_dtype: str | None = None,
    labels: bool = True,
) -> None:
    """Refuse data the model cannot take, before anything runs: the examples must have the
    model's input shape (``(H, W)`` fits ``(H, W, 1)``, and any shape fits a model that takes
    the same number of values, read row-major like Keras' ``Reshape``), integer values where
    the model's input is declared integer (token ids for an ``Embedding``), and the labels
    must be what the loss reads (:func:`check_labels`)."""
    for key, split in (("x_train", dataset.train), ("x_test", dataset.test)):
        x = split.images
        shape = tuple(x.shape[1:])
        if shape != tuple(input_shape) and math.prod(shape) != math.prod(input_shape):
            raise DataError(
                f"{source}: {key} is {x.dtype} {tuple(x.shape)}, examples of {shape}, but the "
                f"model's input takes (batch, {', '.join(map(str, input_shape))})"
            )
        if (
            input_dtype
            and "int" in str(input_dtype)
            and not np.issubdtype(x.dtype, np.integer)
            and not all_integer(x)
        ):
            raise DataError(
                f"{source}: {key} is {x.dtype} {tuple(x.shape)} with fractional values, but the "
                f"model's input is {input_dtype} (token ids): store integers"
            )
    for key, split in (("y_train", dataset.train), ("y_test", dataset.test)) if labels else ():
        check_labels(split.labels, num_classes, loss or LossSpec(), f"{source}: {key}")


def conform(dataset: Dataset, loss: LossSpec, k: int) -> Dataset:
    """The labels in the form the loss reads, where Keras' ``fit`` takes the file's form too:
    float class ids ``(n, 1)`` for sparse cross-entropy become int64 ``(n,)``; integer labels
    ``(n,)`` (binary 0/1, integer targets) for a one-output binary or regression model become
    float32 ``(n, 1)``. Anything else stays as loaded, for :func:`check_labels` to judge."""

    def labels(y: np.ndarray) -> np.ndarray:
        if loss.positions > 1:
            return _per_position(y, loss, k)
        ids = loss.kind == "sparse" and y.ndim == 2 and y.shape[1] == 1 and len(y) > 0
        if ids and y.min() >= 0 and np.array_equal(y, np.round(y)):
            return y.reshape(len(y)).astype(np.int64)
        if loss.kind in ("binary", "regression") and y.ndim == 1 and k == 1:
            return y.astype(np.float32).reshape(len(y), 1)
        return y

    train, test = (replace(s, labels=labels(s.labels)) for s in (dataset.train, dataset.test))
    return replace(dataset, train=train, test=test)


def _per_position(y: np.ndarray, loss: LossSpec, k: int) -> np.ndarray:
    """Labels for a loss per position, one row per example as the loss's buffer holds them:
    class ids ``(n, *positions)`` or ``(n, *positions, 1)`` → int64 ``(n, P)``; values shaped
    like the output ``(n, *positions, k)`` (or ``(n, *positions)`` for one unit, which Keras
    expands) → float32 ``(n, P * k)``. Anything else stays, for :func:`check_labels`."""
    n, where = len(y), loss.out_shape[:-1]
    if loss.kind == "sparse":
        ids = y.shape[1:] in (where, (*where, 1)) and n and y.min() >= 0
        if ids and np.array_equal(y, np.round(y)):
            return y.reshape(n, loss.positions).astype(np.int64)
        return y
    if y.shape[1:] == loss.out_shape or (k == 1 and y.shape[1:] == where):
        return np.ascontiguousarray(y.reshape(n, loss.positions * k), np.float32)
    return y


def check_labels(y: np.ndarray, k: int, loss: LossSpec, where: str) -> None:
    """Integer class ids below ``k`` for sparse cross-entropy (its ``ignore_class`` too),
    one-hot rows of ``k`` for categorical, rows of ``k`` in [0, 1] for binary, float rows of ``k``
    (the output's shape) for regression; a per-position loss: the same at every position."""
    kind, name = loss.kind, loss.name
    what = f"{where} ({y.dtype} {tuple(y.shape)})"
    if loss.positions > 1:
        shape = ", ".join(map(str, loss.out_shape[:-1] if kind == "sparse" else loss.out_shape))
        width = loss.positions * (1 if kind == "sparse" else k)
        if y.ndim != 2 or y.shape[1] != width or (kind == "sparse" and y.dtype != np.int64):
            raise DataError(
                f"{what}: {name} on the model's output (batch, "
                f"{', '.join(map(str, loss.out_shape))}) reads a loss per position and needs "
                + ("integer class ids " if kind == "sparse" else "labels ")
                + f"(n, {shape})"
            )
        y = y.reshape(-1) if kind == "sparse" else y.reshape(-1, k)
    if kind == "sparse":
        if y.ndim != 1:
            raise DataError(
                f"{what} has {y.shape[1]} float values per example; {name} needs integer "
                "class ids (n,) (one-hot rows need CategoricalCrossentropy)"
            )
        ids = y if loss.arg("ignore_class") is None else y[y != loss.arg("ignore_class")]
        top = int(ids.max()) if len(ids) else 0
        if top >= k:
            raise DataError(f"{where}: label {top} is outside the model's {k} classes (0..{k - 1})")
        return
    if y.ndim != 2 or y.shape[1] != k:
        got = (
            "integer class ids"
            if y.ndim == 1
            else f"rows of {y.shape[1]}"
            if y.ndim == 2
            else f"{tuple(y.shape[1:])} per example"
        )
        raise DataError(
            f"{what} has {got}; {name} needs float rows of {k} values, the model's output "
            + ("(one-hot rows)" if kind == "categorical" else "")
        )
    if kind == "categorical" and not (np.all((y == 0) | (y == 1)) and np.all(y.sum(axis=1) == 1)):
        raise DataError(f"{what}: {name} needs one-hot rows (one 1, the rest 0)")
    if kind == "binary" and not np.all((y >= 0) & (y <= 1)):
        # Keras takes any target in [0, 1] (an autoencoder's pixels), not only 0 and 1
        raise DataError(f"{what}: {name} needs labels between 0 and 1")
