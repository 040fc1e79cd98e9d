"""One array of a user's file, checked and stored as the trainer reads it.

Pipeline position: ``npz`` and ``multi`` read each ``x_*``/``y_*`` array through here, so a
single-input file and a named multi-input file obey the same rules (dtype, shape, exact ids).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ringtrain.errors import DataError

#: the largest integer float32 holds exactly: token ids and integer features beyond it would
#: reach the model rounded
EXACT_INT = 2**24


def read_features(path: Path, key: str, x: np.ndarray) -> np.ndarray:
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


def read_labels(path: Path, key: str, y: np.ndarray) -> np.ndarray:
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


def npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the ``.npy`` starting at ``f``'s position, ``f`` left at
    its data; ValueError for a format this trainer does not read (1.0 and 2.0 are read). One
    reader for every place that checks an array before reading it (shards, checkpoints)."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(f)
    else:
        raise ValueError(f".npy format version {version} (1.0 and 2.0 are read)")
    return tuple(shape), bool(fortran), dtype
