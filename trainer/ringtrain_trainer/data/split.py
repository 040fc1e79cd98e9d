"""The in-memory data set: a train and a test :class:`Split` of examples and labels.

Pipeline position: every loader (``dataset`` for the built-in sets, ``npz`` and ``multi`` for a
user's file) returns a :class:`Dataset`; the worker shards it (``dataset.Sharder``) and feeds
the IPU per batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import DataError


@dataclass(frozen=True)
class Split:
    """Images (uint8 or float32, stored compactly) and int64 labels.

    The one rule of what a model sees: **``images * scale`` as float32**, in training
    (:func:`batch_into`), in every evaluation (the worker's and the evaluator's) and therefore
    in what an exported model expects (:meth:`inputs`). ``scale`` is 1 unless the loader says
    otherwise: a ``.npz`` is fed exactly as it holds its numbers, as Keras' ``model.fit(x)``
    does, so a model that starts with ``Rescaling(1/255)`` gets raw uint8 pixels and scales
    them once. Only the built-in data sets state their ``x / 255`` explicitly
    (:data:`BUILTIN_SCALE`), because the presets and the seeds' models expect [0, 1].
    """

    images: np.ndarray
    labels: np.ndarray
    scale: float = 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def inputs(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Examples ``start:stop`` as the model sees them (a new float32 array)."""
        images = self.images[start:stop]
        out = np.empty(images.shape, np.float32)
        np.multiply(images, np.float32(self.scale), out=out)
        return out


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int = 10
    #: a ``.npz`` named per model input/output (``x_train_<input>``, ...): its arrays by key,
    #: packed for the model by ``data_multi.pack`` once the model is known; None otherwise
    parts: dict | None = None


def dataset_of(path: str | os.PathLike, name: str, splits: dict[str, Split]) -> Dataset:
    """The data set of a file's (or shards') two splits, once they agree: the same example
    shape, the same label shape; the classes from the labels (ids) or their width (one-hot)."""
    tr, te = splits["train"], splits["test"]
    if tr.images.shape[1:] != te.images.shape[1:]:
        raise DataError(
            f"{path}: x_train examples are {tr.images.shape[1:]} but x_test examples "
            f"are {te.images.shape[1:]}"
        )
    if tr.labels.ndim != te.labels.ndim or tr.labels.shape[1:] != te.labels.shape[1:]:
        raise DataError(
            f"{path}: y_train labels are {tr.labels.dtype} {tr.labels.shape[1:]} per example but "
            f"y_test labels are {te.labels.dtype} {te.labels.shape[1:]}"
        )
    if tr.labels.ndim == 1:
        num_classes = int(max(tr.labels.max(), te.labels.max())) + 1
    else:
        num_classes = tr.labels.shape[1]
    return Dataset(name, tr, te, num_classes=num_classes)
