"""A data set too big for memory: a directory or glob of ``.npz`` / ``.npy`` shards, streamed.

Pipeline position: :func:`ringtrain_trainer.data.dataset.load` hands ``--data`` here when
:func:`is_sharded` says it names shards; the result is an ordinary
:class:`~ringtrain_trainer.data.split.Dataset` whose ``x`` arrays are
:class:`~ringtrain_trainer.data.rows.ShardedArray` (read per batch, never whole) and whose
labels are in memory (8 bytes per example for class ids: 1 % of a 28x28 image).

The layout (docs/your-model-and-data.md, decision 0209): ``--data`` is a directory (its own
files, not sub-directories) or a glob; each file is a shard, in sorted path order:

* ``NAME.npz`` written by ``np.savez`` (uncompressed: a member is read in place by its offset)
  holding ``x_train`` and ``y_train`` and, in any shard, ``x_test`` and ``y_test``;
* or pairs of ``.npy`` files ``x_train*.npy`` + ``y_train*.npy`` and ``x_test*.npy`` +
  ``y_test*.npy``, paired by what follows the split name (``x_train-007.npy`` with
  ``y_train-007.npy``).

The examples of a split are the shards' rows concatenated in that order, so a data set cut
into shards at any boundaries is the same data set, sample for sample, as the one ``.npz`` of
the concatenation (the order of training, ``Sharder``'s, numbers these samples). Every shard
must agree on the example shape and dtype (refused naming the file and the array); the fit to
the model is checked as for a ``.npz`` (``npz.fit_model``), before training.
"""

from __future__ import annotations

import glob
import os
import re
import struct
import zipfile
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.arrays import EXACT_INT, npy_header, read_labels
from ringtrain_trainer.data.rows import Part, ShardedArray
from ringtrain_trainer.data.split import Dataset, Split, dataset_of

GLOB_CHARS = re.compile(r"[*?\[]")
#: a ``.npy`` shard: ``x_train-007.npy`` → ("x", "train", "-007")
NPY_NAME = re.compile(r"^([xy])_(train|test)(.*)\.npy$")
SPLITS = ("train", "test")
#: rows per read when a load-time scan must see every value (integer features' range)
SCAN_ROWS = 4096


def shard_files(path: str | os.PathLike) -> list[Path] | None:
    """The shard files ``path`` names (sorted), or None when it names no shards: a directory
    holding no ``.npz`` / ``x_*.npy`` (a directory of IDX files) or a plain file."""
    p = str(path)
    if GLOB_CHARS.search(p):
        files = sorted(Path(f) for f in glob.glob(p) if Path(f).is_file())
        if not files:
            raise DataError(f"{p}: the pattern matches no file")
        return files
    d = Path(p)
    if not d.is_dir():
        return None
    files = sorted(
        f for f in d.iterdir() if f.is_file() and (f.suffix == ".npz" or NPY_NAME.match(f.name))
    )
    return files or None


def is_sharded(path: str | os.PathLike) -> bool:
    return shard_files(path) is not None


def _header(f, path: Path, member: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, byte offset of the data) of the ``.npy`` starting at ``f``'s position."""
    try:
        shape, fortran, dtype = npy_header(f)
    except ValueError as e:
        raise DataError(f"{path}: {member}: not a readable .npy header ({e})") from None
    if fortran and len(shape) > 1:
        raise DataError(f"{path}: {member} is stored in Fortran order; save a C-ordered array")
    if dtype.hasobject or not dtype.isnative:
        raise DataError(f"{path}: {member} has dtype {dtype}; shards hold native numbers")
    if len(shape) < 1:
        raise DataError(f"{path}: {member} is a scalar; expected one row per example (n, ...)")
    return tuple(shape), dtype, f.tell()


def _npz_members(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """Each member of an uncompressed ``.npz``: its array's shape, dtype and data offset."""
    out = {}
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            for info in z.infolist():
                key = info.filename.removesuffix(".npy")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise DataError(
                        f"{path}: {key} is compressed (np.savez_compressed); a shard is read in "
                        "place by offset: write it with np.savez, or as .npy files"
                    )
                f.seek(info.header_offset)
                local = f.read(30)
                if len(local) != 30 or local[:4] != b"PK\x03\x04":
                    raise DataError(f"{path}: {key}: bad zip local header")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                f.seek(info.header_offset + 30 + name_len + extra_len)
                out[key] = _header(f, path, key)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz archive ({e})") from None
    return out


def _npy_member(path: Path, key: str) -> tuple[tuple[int, ...], np.dtype, int]:
    try:
        with open(path, "rb") as f:
            return _header(f, path, key)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _labels(path: Path, key: str, offset: int, shape, dtype) -> np.ndarray:
    """A shard's labels, read whole (they are small) and checked as a ``.npz``'s are."""
    count = int(np.prod(shape, dtype=np.int64))
    y = np.fromfile(path, dtype, count=count, offset=offset)
    if y.size != count:
        raise DataError(f"{path}: {key} is truncated ({y.size} of {count} values)")
    return read_labels(path, key, y.reshape(shape))


def _entries(files: list[Path]):
    """(file, split, x (shape, dtype, offset), y file, y (shape, dtype, offset)) per shard."""
    npy = {}
    for f in files:
        if f.suffix == ".npz":
            members = _npz_members(f)
            unknown = sorted(set(members) - {f"{a}_{s}" for a in "xy" for s in SPLITS})
            if unknown:
                raise DataError(
                    f"{f}: array {unknown[0]!r} is not x_train/y_train/x_test/y_test (a sharded "
                    "data set names its arrays like a .npz; one per model input is not "
                    "supported for shards)"
                )
            for s in SPLITS:
                has = [k in members for k in (f"x_{s}", f"y_{s}")]
                if has[0] != has[1]:
                    missing = f"x_{s}" if not has[0] else f"y_{s}"
                    raise DataError(f"{f}: has {'xy'[has[0]]}_{s} but no {missing}")
                if has[0]:
                    yield f, s, members[f"x_{s}"], f, members[f"y_{s}"]
            continue
        m = NPY_NAME.match(f.name)
        if m is None:
            raise DataError(
                f"{f}: not a shard (a .npz, or x_train*/y_train*/x_test*/y_test* .npy files)"
            )
        npy[(m.group(1), m.group(2), m.group(3), f.parent)] = f
    for (kind, s, suffix, parent), f in sorted(npy.items(), key=lambda kv: str(kv[1])):
        other = npy.get(("y" if kind == "x" else "x", s, suffix, parent))
        if other is None:
            partner = parent / f"{'y' if kind == 'x' else 'x'}_{s}{suffix}.npy"
            raise DataError(f"{f}: its partner {partner.name} is missing")
        if kind == "x":
            yield f, s, _npy_member(f, f"x_{s}"), other, _npy_member(other, f"y_{s}")


def load_sharded(path: str | os.PathLike) -> Dataset:
    """The shards ``path`` names as a :class:`Dataset`: inputs streamed, labels in memory."""
    files = shard_files(path)
    if files is None:
        raise DataError(f"{path}: no .npz or x_train*.npy shards here")
    parts: dict[str, list[Part]] = {s: [] for s in SPLITS}
    labels: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    first: dict[str, tuple[Path, tuple[int, ...], np.dtype]] = {}
    for f, s, (xs, xd, xo), yf, (ys, yd, yo) in sorted(_entries(files), key=lambda e: str(e[0])):
        key = f"x_{s}"
        if s in first:
            f0, shape0, dtype0 = first[s]
            if (xs[1:], xd) != (shape0, dtype0):
                raise DataError(
                    f"{f}: {key} is {xd} examples of {xs[1:]}, but {f0}: {key} is {dtype0} "
                    f"examples of {shape0}; every shard must agree"
                )
        else:
            first[s] = (f, xs[1:], xd)
        _check_dtype(f, key, xd)
        y = _labels(yf, f"y_{s}", yo, ys, yd)
        if len(y) != xs[0]:
            raise DataError(f"{f}: {key} has {xs[0]} examples but {yf}: y_{s} has {len(y)} labels")
        ref = labels[s][0] if labels[s] else None
        if ref is not None and (y.dtype, y.shape[1:]) != (ref.dtype, ref.shape[1:]):
            raise DataError(
                f"{yf}: y_{s} labels are {y.dtype} {y.shape[1:]} per example, but the first "
                f"shard's are {ref.dtype} {ref.shape[1:]}"
            )
        parts[s].append(Part(str(f), key, xo, xs[0]))
        labels[s].append(y)
    splits = {}
    for s in SPLITS:
        if s not in first or sum(p.rows for p in parts[s]) == 0:
            raise DataError(f"{path}: no shard holds any x_{s} examples")
        f0, shape0, dtype0 = first[s]
        x = ShardedArray(parts[s], shape0, dtype0)
        _check_ints(x, f"x_{s}")
        splits[s] = Split(x, np.concatenate(labels[s]))  # type: ignore[arg-type]
    name = Path(str(path).rstrip("/*")).name or "shards"
    return dataset_of(path, name, splits)


def _check_dtype(path: Path, key: str, dtype: np.dtype) -> None:
    """What ``arrays.read_features`` takes: uint8, other integers (ids), floats."""
    ok = dtype == np.uint8 or np.issubdtype(dtype, np.floating)
    if not ok and not (np.issubdtype(dtype, np.integer) and dtype != np.bool_):
        raise DataError(
            f"{path}: {key} has dtype {dtype}; expected uint8, integer (token ids) or float"
        )


def _check_ints(x: ShardedArray, key: str) -> None:
    """Integer features other than uint8 must be exact in float32: one scan at load time."""
    if x.dtype == np.uint8 or not np.issubdtype(x.dtype, np.integer):
        return
    at = 0
    for chunk in x.chunks(SCAN_ROWS):
        top = max(abs(int(chunk.min())), abs(int(chunk.max()))) if chunk.size else 0
        if top > EXACT_INT:
            worst = np.abs(chunk.reshape(len(chunk), -1).astype(np.int64)).max(axis=1)
            p = _part_of(x, at + int(np.argmax(worst)))
            raise DataError(
                f"{p.path}: {key} holds {top}; integer inputs must stay within ±{EXACT_INT} "
                "(exact in float32)"
            )
        at += len(chunk)


def _part_of(x: ShardedArray, row: int) -> Part:
    for p in x.parts:
        if row < p.rows:
            return p
        row -= p.rows
    return x.parts[-1]


def all_integer(x) -> bool:
    """Whether every value of ``x`` (an ndarray, or shards scanned chunk by chunk) is whole."""
    if isinstance(x, ShardedArray):
        return all(np.array_equal(c, np.round(c)) for c in x.chunks(SCAN_ROWS))
    return bool(np.array_equal(x, np.round(x)))
