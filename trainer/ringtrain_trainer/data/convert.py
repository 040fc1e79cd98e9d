"""``ringtrain data convert``: a ``.npz``, TFRecord or Parquet files into the ``.npy`` shards the
trainer streams.

Pipeline position: run once, before training; its output directory is what
``spec.trainer.data`` (``--data``) then names, read by :mod:`.shards` in place. Why convert
rather than stream TFRecord (decision 0215): a record is found only by walking the file's
framing and decoded by a Python protobuf walk, while a ``.npy`` row is one ``preadv`` at a
known offset — so the trainer's random access in the Sharder's order, its batch-ahead reads
and its exact resume stay as they are, for one pass over the data at conversion.

Memory: one shard's rows at a time (:data:`SHARD_BYTES` by default), whatever the input's
size — a ``.npz`` member is read as a stream (compressed ones too), TFRecord a block at a time,
Parquet a row group at a time (decision 0216).
The output appears whole or not at all: shards are written into ``DEST.partial-PID`` and
renamed to ``DEST`` at the end; a refusal removes them.
"""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.arrays import npy_header
from ringtrain_trainer.data.mapping import Field, Resolved
from ringtrain_trainer.data.parquet import Column, batches, parquet_files, resolve
from ringtrain_trainer.data.tfrecord import examples, tfrecord_files

#: the x bytes of one output shard (the last of a split holds the rest)
SHARD_BYTES = 64 << 20
KEYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass
class Summary:
    """What a conversion wrote (``ringtrain data convert``'s report)."""

    source: str
    format: str
    dest: str
    rows: dict[str, int] = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    mapping: list[str] = field(default_factory=list)


class ShardWriter:
    """Rows of one split, buffered and written as ``x_SPLIT-NNNNN.npy`` + ``y_SPLIT-NNNNN.npy``
    every ``rows_per_shard`` rows."""

    def __init__(self, dest: Path, split: str, x: tuple, y: tuple, shard_bytes: int):
        self.dest, self.split = dest, split
        row = int(np.prod(x[0], dtype=np.int64)) * np.dtype(x[1]).itemsize
        self.per = max(1, shard_bytes // max(1, row))
        self.x = np.empty((self.per, *x[0]), x[1])
        self.y = np.empty((self.per, *y[0]), y[1])
        self.n = self.rows = self.shards = self.bytes = 0

    def row(self) -> tuple[np.ndarray, np.ndarray]:
        """The next row's slots, ``(1, *shape)`` views the caller fills; full shards are written
        first."""
        if self.n == self.per:
            self.flush()
        self.n += 1
        self.rows += 1
        return self.x[self.n - 1 : self.n], self.y[self.n - 1 : self.n]  # views, scalars too

    def extend(self, x: np.ndarray, y: np.ndarray) -> None:
        a = 0
        while a < len(x):
            if self.n == self.per:
                self.flush()
            take = min(self.per - self.n, len(x) - a)
            self.x[self.n : self.n + take] = x[a : a + take]
            self.y[self.n : self.n + take] = y[a : a + take]
            self.n, self.rows, a = self.n + take, self.rows + take, a + take

    def flush(self) -> None:
        if self.n == 0:
            return
        for kind, arr in (("x", self.x), ("y", self.y)):
            path = self.dest / f"{kind}_{self.split}-{self.shards:05d}.npy"
            np.save(path, arr[: self.n])
            self.bytes += path.stat().st_size
        self.shards += 1
        self.n = 0


def partial_dir(dest: Path):
    """A fresh directory beside ``dest`` for the shards, refused when ``dest`` holds anything."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DataError(f"{dest}: exists and is not an empty directory; give a new one")
    tmp = dest.parent / f"{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


@contextmanager
def staged(dest: Path) -> Iterator[Path]:
    """The directory a conversion writes into (:func:`partial_dir`), removed when it fails."""
    tmp = partial_dir(dest)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finish(tmp: Path, dest: Path, writers: dict[str, ShardWriter], s: Summary, t0: float):
    for name, w in writers.items():
        w.flush()
        s.rows[name], s.shards[name] = w.rows, w.shards
        s.bytes_written += w.bytes
    if dest.exists():
        dest.rmdir()
    os.rename(tmp, dest)
    s.seconds = time.perf_counter() - t0
    return s


def _npz_stream(z: zipfile.ZipFile, path: Path, key: str):
    """(shape, dtype, open stream at the data) of member ``key``."""
    try:
        f = z.open(f"{key}.npy")
    except KeyError:
        raise DataError(
            f"{path}: has no {key} (a .npz to convert holds {', '.join(KEYS)})"
        ) from None
    try:
        shape, fortran, dtype = npy_header(f)
    except ValueError as e:
        raise DataError(f"{path}: {key}: not a readable .npy header ({e})") from None
    if fortran and len(shape) > 1:
        raise DataError(f"{path}: {key} is stored in Fortran order; save a C-ordered array")
    if dtype.hasobject or len(shape) < 1:
        raise DataError(f"{path}: {key} is {dtype} {shape}; expected numbers, one row per example")
    return shape, dtype, f


def convert_npz(src: str | os.PathLike, dest: str | os.PathLike, shard_bytes=SHARD_BYTES):
    """``x_train``... of one ``.npz`` (compressed or not) as shards, a shard's rows at a time."""
    src, dest, t0 = Path(src), Path(dest), time.perf_counter()
    s = Summary(str(src), "npz", str(dest), bytes_read=src.stat().st_size)
    with staged(dest) as tmp:
        try:
            with zipfile.ZipFile(src) as z:
                extra = sorted({i.filename.removesuffix(".npy") for i in z.infolist()} - set(KEYS))
                if extra:
                    raise DataError(
                        f"{src}: holds {extra[0]!r}; shards hold {', '.join(KEYS)} only (one "
                        "input and one label)"
                    )
                writers = {}
                for split in ("train", "test"):
                    xs, xd, xf = _npz_stream(z, src, f"x_{split}")
                    ys, yd, yf = _npz_stream(z, src, f"y_{split}")
                    if xs[0] != ys[0]:
                        raise DataError(f"{src}: x_{split} has {xs[0]} rows but y_{split} {ys[0]}")
                    w = writers[split] = ShardWriter(
                        tmp, split, (xs[1:], xd), (ys[1:], yd), shard_bytes
                    )
                    xrow = int(np.prod(xs[1:], dtype=np.int64)) * xd.itemsize
                    yrow = int(np.prod(ys[1:], dtype=np.int64)) * yd.itemsize
                    with xf, yf:
                        for a in range(0, xs[0], w.per):
                            n = min(w.per, xs[0] - a)
                            x = _read(xf, n * xrow, src, f"x_{split}").view(xd).reshape(n, *xs[1:])
                            y = _read(yf, n * yrow, src, f"y_{split}").view(yd).reshape(n, *ys[1:])
                            w.extend(x, y)
                return finish(tmp, dest, writers, s, t0)
        except zipfile.BadZipFile as e:
            raise DataError(f"{src}: not a readable .npz archive ({e})") from None


def _read(f, size: int, path: Path, key: str) -> np.ndarray:
    data = f.read(size)
    if len(data) != size:
        raise DataError(f"{path}: {key} is truncated")
    return np.frombuffer(data, np.uint8)


@dataclass(frozen=True)
class Mapped:
    """How :func:`convert_mapped` reads a format whose fields are mapped to x and y by the user
    (TFRecord features, Parquet columns): one loop over splits, files and items for both, so
    their shards, refusals and whole-or-nothing output cannot drift apart."""

    format: str  # the Summary's
    name: str  # in messages: "TFRecord"
    unit: str  # what a file holds: "record"
    files: Callable[[str | os.PathLike], list[Path] | None]
    #: a file's items: a record, or a batch of rows
    items: Callable[[Path], Iterator[Any]]
    #: (x, y) fixed by the first training item: each with .shape, .dtype, .describe()
    resolve: Callable[[Any], tuple[Any, Any]]
    #: an item's rows into the split's writer
    write: Callable[[Any, tuple[Any, Any], ShardWriter], None]


def convert_mapped(
    m: Mapped, train: str | os.PathLike, test: str | os.PathLike, dest, shard_bytes: int
) -> Summary:
    """The items of ``train``'s and ``test``'s files as shards of ``dest``, mapped as the first
    training item fixes it."""
    dest, t0 = Path(dest), time.perf_counter()
    s = Summary(f"{train} + {test}", m.format, str(dest))
    with staged(dest) as tmp:
        writers: dict[str, ShardWriter] = {}
        fields: tuple[Any, Any] | None = None
        for split, src in (("train", train), ("test", test)):
            files = m.files(src)
            if files is None:
                raise DataError(f"{src}: no {m.name} file here (the {split} split)")
            for path in files:
                s.bytes_read += path.stat().st_size
                for item in m.items(path):
                    if fields is None:
                        fields = m.resolve(item)
                        s.mapping = [fields[0].describe(), fields[1].describe()]
                    if split not in writers:
                        writers[split] = ShardWriter(
                            tmp,
                            split,
                            (fields[0].shape, fields[0].dtype),
                            (fields[1].shape, fields[1].dtype),
                            shard_bytes,
                        )
                    m.write(item, fields, writers[split])
            if split not in writers:
                raise DataError(f"{src}: the {split} split's {m.name} files hold no {m.unit}")
        return finish(tmp, dest, writers, s, t0)


def _tfrecord(x: Field, y: Field) -> Mapped:
    """TFRecord files' ``tf.train.Example`` records, features mapped by :mod:`.mapping`."""

    def write(item, fields: tuple[Resolved, Resolved], w: ShardWriter) -> None:
        path, index, features = item
        xo, yo = w.row()
        fields[0].extract(path, index, features, xo)
        fields[1].extract(path, index, features, yo)

    return Mapped(
        "tfrecord",
        "TFRecord",
        "record",
        tfrecord_files,
        examples,
        lambda item: (x.resolve(*item), y.resolve(*item)),
        write,
    )


def _parquet(x: Field, y: Field) -> Mapped:
    """Parquet files' rows, a batch of a row group at a time, columns mapped by
    :mod:`.parquet`."""

    def items(path: Path) -> Iterator[tuple[Path, int, Any]]:
        for first, batch in batches(path, [x.feature, y.feature]):
            if batch.num_rows:
                yield path, first, batch

    def write(item, cols: tuple[Column, Column], w: ShardWriter) -> None:
        w.extend(cols[0].extract(*item), cols[1].extract(*item))

    return Mapped(
        "parquet",
        "Parquet",
        "row",
        parquet_files,
        items,
        lambda item: (resolve(x, *item), resolve(y, *item)),
        write,
    )


#: the formats whose fields the user maps (``--x``/``--y``), by :attr:`Summary.format`
MAPPED = {"tfrecord": _tfrecord, "parquet": _parquet}


def convert_fields(
    fmt: str,
    train: str | os.PathLike,
    test: str | os.PathLike,
    dest: str | os.PathLike,
    x: Field,
    y: Field,
    shard_bytes: int = SHARD_BYTES,
) -> Summary:
    """The ``fmt`` files (``tfrecord``, ``parquet``) ``train`` and ``test`` name (files,
    directories or globs), their fields mapped by ``x`` and ``y``, as shards of ``dest``."""
    return convert_mapped(MAPPED[fmt](x, y), train, test, dest, shard_bytes)


#: ``convert_tfrecord(train, test, dest, x, y, shard_bytes)``, and likewise for Parquet
convert_tfrecord = partial(convert_fields, "tfrecord")
convert_parquet = partial(convert_fields, "parquet")
