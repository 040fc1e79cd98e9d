"""A ``.npz`` for a model with several inputs or outputs: arrays named per input and output,
packed into the one ``x`` and ``y`` per example the trainer moves.

The convention (README, decisions): ``x_train_<input name>`` / ``x_test_<input name>`` per
model input and ``y_train_<output name>`` / ``y_test_<output name>`` per output — the names
Keras users pass to ``fit(x={"name": array}, y={"name": array})``, prefixed with the split as
a one-input file's ``x_train`` is. Plain ``x_train``/``x_test`` still serve a model with one
input, plain ``y_train``/``y_test`` a model with one trained output. An output compiled with
loss None takes no labels (a file that gives some is refused rather than ignored).

Every array is checked against its input (shape, integer values for an integer input) or its
output's loss (``data_npz.check_labels``) before anything runs, the error naming the input or
output; then the inputs are packed row-major side by side as float32 ``(n, sum of sizes)`` in
``input_layers`` order, and the labels as float32 ``(n, sum of label widths)`` in output order
(class ids one exact float column): what ``engine.program.Program`` and
``engine.multiloss.MultiLoss`` cut apart again.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.arrays import read_features, read_labels
from ringtrain_trainer.data.fit import check_fits, check_labels, conform
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.engine.multiloss import Head

#: a key named per input/output
NAMED = re.compile(r"^([xy])_(train|test)_(.+)$")
PLAIN = re.compile(r"^([xy])_(train|test)$")


def load_named(path: Path, arrays: dict[str, np.ndarray]) -> Dataset:
    """Keep a named file's arrays (each validated alone) until the model is known."""
    parts: dict[str, np.ndarray] = {}
    for k, v in arrays.items():
        m = NAMED.match(k) or PLAIN.match(k)
        if m is None:
            raise DataError(
                f"{path}: array {k!r} is neither x_train/x_test/y_train/y_test nor named per "
                "model input/output (x_train_<input>, y_train_<output>, ...)"
            )
        parts[k] = (read_features if m.group(1) == "x" else read_labels)(path, k, v)
    for split in ("train", "test"):
        xs = [k for k in parts if k.startswith(f"x_{split}")]
        if not xs:
            raise DataError(f"{path}: no x_{split} or x_{split}_<input> array")
    first = {s: next(k for k in sorted(parts) if k.startswith(f"x_{s}")) for s in ("train", "test")}
    placeholder = {s: Split(parts[first[s]], np.zeros(len(parts[first[s]]))) for s in first}
    return Dataset(path.stem, placeholder["train"], placeholder["test"], 0, parts)


def _pick(parts: dict, kind: str, split: str, name: str, only: bool) -> str | None:
    key = f"{kind}_{split}_{name}"
    if key in parts:
        return key
    return f"{kind}_{split}" if only and f"{kind}_{split}" in parts else None


def pack(dataset: Dataset, config, source: str | os.PathLike) -> Dataset:
    """The named arrays packed for ``config`` (a ``keras.config.ModelConfig`` with several
    inputs or outputs); every mismatch a :class:`DataError` naming the input or output."""
    if config is None or not config.multi:
        raise DataError(
            f"{source}: arrays named per input/output ({', '.join(sorted(dataset.parts or {}))}) "
            "need a Keras model with several inputs or outputs"
        )
    parts = dataset.parts
    if parts is None:  # a plain file: x_train etc. serve one input / one trained output
        parts = {
            f"{k}_{s}": getattr(getattr(dataset, "train" if s == "train" else "test"), a)
            for s in ("train", "test")
            for k, a in (("x", "images"), ("y", "labels"))
        }
    loss = config.loss
    several = hasattr(loss, "heads")
    width = config.out_shape_of(config.output)[-1]
    heads = list(loss.heads) if several else [Head(config.output_names[0], loss, 1.0, width)]
    trained = [h for h in heads if h.loss is not None]
    used: set[str] = set()
    splits = {}
    for split in ("train", "test"):
        xs, n = [], None
        for inp in config.inputs:
            key = _pick(parts, "x", split, inp.name, len(config.inputs) == 1)
            if key is None:
                raise DataError(
                    f"{source}: no x_{split}_{inp.name} for the model's input {inp.name!r} "
                    f"{inp.dtype} (batch, {', '.join(map(str, inp.shape))}) (has "
                    f"{', '.join(sorted(parts))})"
                )
            x = parts[key]
            one = Dataset("", Split(x, np.zeros(len(x))), Split(x, np.zeros(len(x))), 0)
            try:
                check_fits(one, inp.shape, 0, source, None, inp.dtype, labels=False)
            except DataError as e:
                raise DataError(f"{e} (input {inp.name!r}, array {key})") from None
            xs.append(x)
            used.add(key)
            n = len(x) if n is None else n
            if len(x) != n:
                raise DataError(f"{source}: {key} has {len(x)} examples, other inputs {n}")
        if len(xs) == 1:
            packed_x = xs[0]
        else:
            packed_x = np.empty((n, sum(math.prod(i.shape) for i in config.inputs)), np.float32)
            at = 0
            for x in xs:
                w = math.prod(x.shape[1:])
                packed_x[:, at : at + w] = x.reshape(n, w)
                at += w
        ys = []
        for h in heads:
            key = _pick(parts, "y", split, h.name, len(trained) == 1 and h.loss is not None)
            if h.loss is None:
                if key is not None:
                    raise DataError(
                        f"{source}: {key} gives labels for output {h.name!r}, which is compiled "
                        "with loss None (Keras trains nothing from it): drop the array"
                    )
                continue
            if key is None:
                raise DataError(
                    f"{source}: no y_{split}_{h.name} for the model's output {h.name!r} "
                    f"({h.loss.name}) (has {', '.join(sorted(parts))})"
                )
            y = parts[key]
            single = Dataset("", Split(y, y), Split(y, y), 0)
            y = conform(single, h.loss, h.width).train.labels
            check_labels(y, h.width, h.loss, f"{source}: {key} (output {h.name!r})")
            if len(y) != n:
                raise DataError(f"{source}: {key} has {len(y)} labels for {n} examples")
            ys.append(y.reshape(n, -1).astype(np.float32) if several else y)
            used.add(key)
        packed_y = np.concatenate(ys, axis=1) if several else ys[0]
        splits[split] = Split(packed_x, np.ascontiguousarray(packed_y))
    unused = sorted(set(parts) - used)
    if unused:
        raise DataError(
            f"{source}: {', '.join(unused)} name no input or output of the model (inputs: "
            f"{', '.join(i.name for i in config.inputs)}; outputs: "
            f"{', '.join(h.name for h in heads)})"
        )
    return replace(dataset, train=splits["train"], test=splits["test"], parts=None)
