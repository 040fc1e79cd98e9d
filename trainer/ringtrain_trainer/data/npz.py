"""Your data: a ``.npz`` of ``x_train, y_train, x_test, y_test``, and its fit to the model.

Pipeline position: :func:`ringtrain_trainer.data.dataset.load` hands a path ending in ``.npz`` here;
the worker and the evaluator then call :func:`fit_model` before the first step. The file is
what ``np.savez(path, x_train=..., ...)`` writes: examples of any shape and dtype the model's
input declares — images ``(n, H, W[, C])`` uint8 or float, 2-D tables ``(n, features)``, int
token ids ``(n, seq)`` — and labels as the model's loss reads them: integer class ids ``(n,)``
/ ``(n, 1)`` (sparse cross-entropy), one-hot rows ``(n, classes)`` (categorical), 0/1 labels
``(n,)`` / ``(n, k)`` (binary), float targets ``(n,)`` / ``(n, k)`` (regression). Every
mismatch with the model is refused before training, naming the array, its dtype and shape and
what the model expects. The model is fed the numbers exactly as the file holds them, cast to
float32, as Keras' ``model.fit(x)`` does (``data.Split``'s rule, ``scale`` 1): uint8 pixels stay
0..255 (stored as uint8, cast per batch), so a model that starts with ``Rescaling(1/255)``
scales them once, in training, evaluation and its export alike; a model without one wants a
file of ``x / 255`` as float. The exported model expects what the file holds.
"""

from __future__ import annotations

import math
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data import multi as data_multi
from ringtrain_trainer.data.dataset import Dataset, Split
from ringtrain_trainer.engine.loss_spec import LossSpec

KEYS = ("x_train", "y_train", "x_test", "y_test")


#: the largest integer float32 holds exactly: token ids and integer features beyond it would
#: reach the model rounded
EXACT_INT = 2**24


def _features(path: Path, key: str, x: np.ndarray) -> np.ndarray:
    """Examples of any shape ``(n, ...)``: images, 2-D tables, int token ids. uint8 and other
    integers are stored as they are (cast to float32 per batch, exactly: ids below 2**24),
    floats as float32."""
    if x.ndim < 1:
        raise DataError(f"{path}: {key} is a scalar; expected one row per example (n, ...)")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return np.ascontiguousarray(x, np.float32)
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.bool_:
        if x.size and max(abs(int(x.min())), abs(int(x.max()))) > EXACT_INT:
            raise DataError(
                f"{path}: {key} ({x.dtype}, shape {x.shape}) holds {int(np.abs(x).max())}; "
                f"integer inputs must stay within ±{EXACT_INT} (exact in float32)"
            )
        return np.ascontiguousarray(x)
    raise DataError(
        f"{path}: {key} has dtype {x.dtype}; expected uint8, integer (token ids) or float "
        "(fed to the model as stored)"
    )


def _labels(path: Path, key: str, y: np.ndarray) -> np.ndarray:
    """Integer class ids ``(n,)`` / ``(n, 1)`` → int64 ``(n,)``; anything else numeric (one-hot
    or {0, 1} rows, regression targets) → float32 ``(n, k)``, or ``(n, *shape)`` for a loss per
    position (a tag per timestep, a value per pixel). Whether they suit the model's loss
    is :func:`conform`'s and :func:`check_labels`' to say, once the model is known."""
    if y.dtype == np.bool_ or not (
        np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
    ):
        raise DataError(f"{path}: {key} has dtype {y.dtype}; expected integer or float labels")
    if np.issubdtype(y.dtype, np.integer) and (y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)):
        y = y.reshape(len(y))
        if len(y) and y.min() < 0:
            raise DataError(f"{path}: {key} has negative label {int(y.min())}")
        return y.astype(np.int64)
    if y.ndim == 1:
        y = y[:, None]
    if not np.all(np.isfinite(y)):
        raise DataError(f"{path}: {key} has a NaN or infinite label")
    return np.ascontiguousarray(y, np.float32)


def load_npz(path: str | os.PathLike) -> Dataset:
    """Load a ``.npz`` data set; every problem is a :class:`DataError` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:  # our handle: np.load leaks its own when parsing fails
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise DataError(
                    f"{path}: a single .npy array, not a .npz archive of {', '.join(KEYS)}"
                )
            missing = [k for k in KEYS if k not in z.files]
            if missing and any(data_multi.NAMED.match(k) for k in z.files):
                return data_multi.load_named(path, {k: z[k] for k in z.files})
            if missing:
                raise DataError(
                    f"{path}: missing {', '.join(missing)} (has "
                    f"{', '.join(z.files) or 'nothing'}; needs {', '.join(KEYS)})"
                )
            arrays = {k: z[k] for k in KEYS}
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz archive ({e})") from None
    splits = {}
    for split in ("train", "test"):
        x = _features(path, f"x_{split}", arrays[f"x_{split}"])
        y = _labels(path, f"y_{split}", arrays[f"y_{split}"])
        if len(x) != len(y):
            raise DataError(
                f"{path}: x_{split} has {len(x)} examples but y_{split} has {len(y)} labels"
            )
        if len(x) == 0:
            raise DataError(f"{path}: x_{split} is empty")
        splits[split] = Split(x, y)
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
    return Dataset(path.stem, tr, te, num_classes=num_classes)


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
            and not np.array_equal(x, np.round(x))
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


def raw_pixels_note(dataset: Dataset, spec, source: str | os.PathLike) -> str | None:
    """A note for stderr when uint8 pixels reach a model (``spec``) that has no ``Rescaling``:
    they are fed as 0..255, exactly as ``model.fit(x)`` would feed them, which is rarely what
    was meant (the ``cnn`` preset on mnist-5k as a uint8 .npz: 84.2 % after one epoch against
    88.9 % from ``x / 255`` as float) — and was not what older ringtrain did."""
    if dataset.train.images.dtype != np.uint8 or dataset.train.scale != 1.0:
        return None
    layers = getattr(getattr(spec, "config", None), "layers", ())
    if any(layer.cls == "Rescaling" for layer in layers):
        return None
    return (
        f"{source}: uint8 pixels are fed to the model as stored (0..255), as Keras' "
        "model.fit(x) feeds them, and the model has no Rescaling layer; store x / 255 as "
        "float, or start the model with Rescaling(1/255)"
    )


def fit_model(dataset: Dataset, spec, source: str | os.PathLike) -> tuple[Dataset, str | None]:
    """The data set with its labels :func:`conform`-ed to ``spec``'s loss, checked by
    :func:`check_fits` against a ``model.ModelSpec`` (refusals raise), and the
    :func:`raw_pixels_note` to print, if any: what the worker and the evaluator both run."""
    config = getattr(spec, "config", None)
    if dataset.parts is not None or (config is not None and config.multi):
        return data_multi.pack(dataset, config, source), None
    loss = getattr(spec, "loss", None) or LossSpec()
    dataset = conform(dataset, loss, spec.num_classes)
    check_fits(
        dataset,
        spec.input_shape,
        spec.num_classes,
        source,
        loss,
        # the InputLayer's dtype (``keras.config``'s ``input_dtype``), where the front end reads it
        getattr(getattr(spec, "config", None), "input_dtype", None),
    )
    return dataset, raw_pixels_note(dataset, spec, source)
