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

import os
import zipfile
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data import multi as data_multi
from ringtrain_trainer.data.arrays import read_features, read_labels
from ringtrain_trainer.data.fit import check_fits, conform
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.data.split import Dataset, Split, dataset_of

KEYS = ("x_train", "y_train", "x_test", "y_test")


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
        x = read_features(path, f"x_{split}", arrays[f"x_{split}"])
        y = read_labels(path, f"y_{split}", arrays[f"y_{split}"])
        if len(x) != len(y):
            raise DataError(
                f"{path}: x_{split} has {len(x)} examples but y_{split} has {len(y)} labels"
            )
        if len(x) == 0:
            raise DataError(f"{path}: x_{split} is empty")
        splits[split] = Split(x, y)
    return dataset_of(path, path.stem, splits)


def raw_pixels_note(dataset: Dataset, spec, source: str | os.PathLike) -> str | None:
    """A note for stderr when uint8 pixels reach a model (``spec``) that has no ``Rescaling``:
    they are fed as 0..255, exactly as ``model.fit(x)`` would feed them, which is rarely what
    was meant (the ``cnn`` preset on mnist-5k as a uint8 .npz: 84.2 % after one epoch against
    88.9 % from ``x / 255`` as float) — and was not what older ringtrain did."""
    if dataset.train.images.dtype != np.uint8 or dataset.train.scale != 1.0:
        return None
    layers = spec.config.layers if spec.config is not None else ()
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
    config = spec.config
    if isinstance(dataset.train.images, ShardedArray):  # name the file, not only the pattern
        if config is not None and config.multi:
            raise DataError(
                f"{source}: shards for a model with several inputs or outputs: "
                "not supported yet (use one .npz named per input)"
            )
        parts = dataset.train.images.parts
        source = f"{parts[0].path} (first of {len(parts)} shards in {source})"
    if dataset.parts is not None or (config is not None and config.multi):
        return data_multi.pack(dataset, config, source), None
    loss = spec.loss
    dataset = conform(dataset, loss, spec.num_classes)
    check_fits(
        dataset,
        spec.input_shape,
        spec.num_classes,
        source,
        loss,
        # the InputLayer's dtype (``keras.config``'s ``input_dtype``), where the front end reads it
        (spec.config.input_dtype if spec.config is not None else None),
    )
    return dataset, raw_pixels_note(dataset, spec, source)
