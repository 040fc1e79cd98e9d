"""Parquet files read with pyarrow, a row group at a time, their columns mapped to the model's
input and label as TFRecord features are (decision 0216).

Pipeline position: ``ringtrain data inspect`` (:mod:`.describe`) and ``ringtrain data convert``
(:func:`.convert.convert_parquet`) read Parquet through :func:`batches`; :class:`Column` turns
one batch of a column into the rows of the ``x_*`` / ``y_*`` shards. The trainer never reads
Parquet: it trains from the shards ``convert`` writes, as for TFRecord (decision 0215).

pyarrow is imported here only, inside functions: it is the optional extra ``data``
(``pip install 'ringtrain[data]'``), not part of the runtime install a worker trains with.

How a column becomes a row (``--x COLUMN [--x-shape 28,28] [--x-dtype uint8]``), as
TensorFlow's features do in :mod:`.mapping`:

* a numeric column (integers or floats): one value per row; a label is a scalar (a class id);
* a list column (``list``, ``large_list``, ``fixed_size_list``) of numbers: the row's values,
  flat or reshaped by ``--x-shape``, every row holding as many as the first;
* a binary column (``binary``, ``large_binary``, ``fixed_size_binary``): the row's raw array
  bytes (``np.frombuffer``, little endian), ``--x-dtype`` their type (default uint8), like a
  ``bytes_list`` of one value.

Values keep the column's type unless a dtype is given: a narrower integer type (uint8 pixels)
every value must fit exactly, or any float type for floats; a float column is never rounded
into integers. A missing column, another kind of column than the first file's, a row of
another length, a null, a value the dtype cannot hold, an unsupported type (strings, nested
lists) and a file pyarrow cannot read are refused naming the file, the row (counted from 0 in
its file, as ``pq.read_table`` orders them) when one row is at fault, and the column.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.mapping import Field, Fixed, cast_exact, shape_text, wrong_length
from ringtrain_trainer.data.sources import listed_files

MAGIC = b"PAR1"
#: decoded bytes per batch read from a row group (the row group's own size when smaller)
BATCH_BYTES = 8 << 20
INSTALL = "pip install 'ringtrain[data]'"
#: bytes of a file read at a time when decoding its pages
READ_BUFFER = 1 << 20


def pyarrow() -> tuple[Any, Any, Any]:
    """(pyarrow, pyarrow.parquet, pyarrow.compute), or a refusal naming the install."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"Parquet files are read with pyarrow, which is not installed ({INSTALL})"
        ) from None
    return pa, pq, pc


def looks_like_parquet(path: Path) -> bool:
    """Whether ``path`` starts with Parquet's magic bytes (a truncated file still does, and is
    then refused by pyarrow's reading, naming it)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def parquet_files(path: str | os.PathLike) -> list[Path] | None:
    """The Parquet files ``path`` names (a file, a directory's own files, a glob's), sorted;
    None when it names none."""
    found = [f for f in listed_files(path) if looks_like_parquet(f)]
    return found or None


def open_file(path: Path):
    """``pq.ParquetFile`` of ``path``, page checksums verified where the writer stored them.
    Its pages are read through a buffer of :data:`READ_BUFFER` rather than each row group's
    column chunks pre-buffered whole (pyarrow's default): measured on 64 MiB row groups, the
    peak was 255 MiB instead of 317."""
    pa, pq, _ = pyarrow()
    try:
        return pq.ParquetFile(
            path, page_checksum_verification=True, pre_buffer=False, buffer_size=READ_BUFFER
        )
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file (pyarrow: {e})") from None


def batches(path: Path, columns: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """(index of its first row in the file, ``pa.RecordBatch``) of ``columns`` (all: None),
    read one row group at a time in batches of about :data:`BATCH_BYTES` decoded."""
    pa, _, _ = pyarrow()
    pf = open_file(path)
    if columns is not None:
        names = pf.schema_arrow.names
        for c in columns:
            if c not in names:
                have = ", ".join(names) or "none"
                raise DataError(f"{path}: no column {c!r} (it has: {have})")
    first = 0
    for g in range(pf.num_row_groups):
        meta = pf.metadata.row_group(g)
        per_row = max(1, meta.total_byte_size // max(1, meta.num_rows))
        size = max(1, min(meta.num_rows, BATCH_BYTES // per_row))
        at = first
        try:
            for batch in pf.iter_batches(size, row_groups=[g], columns=columns, use_threads=False):
                yield at, batch
                at += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(
                f"{path}: row group {g} (rows {first}-{first + meta.num_rows - 1}): not readable "
                f"(pyarrow: {e})"
            ) from None
        first += meta.num_rows


def kind_of(t) -> str | None:
    """The kind of column type ``t`` is ("scalar", "list" or "binary", see the module); None
    for any other type."""
    pa, _, _ = pyarrow()
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t)
    if numeric:
        return "scalar"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        return "list" if pa.types.is_integer(v) or pa.types.is_floating(v) else None
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    return None


def lengths(kind: str, arr) -> np.ndarray:
    """Values (list), bytes (binary) or 1 (scalar) per row of ``arr``; a null row counts 0."""
    _, _, pc = pyarrow()
    if kind == "scalar":
        return np.ones(len(arr), np.int64)
    f = pc.list_value_length if kind == "list" else pc.binary_length
    return f(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def nulls(kind: str | None, arr) -> np.ndarray:
    """Indices of ``arr``'s null rows, or of the rows holding a null value (lists)."""
    out = np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))
    if len(out) == 0 and kind == "list" and arr.flatten().null_count:
        lens = lengths("list", arr)
        bad = np.flatnonzero(~arr.flatten().is_valid().to_numpy(zero_copy_only=False))
        out = np.searchsorted(np.cumsum(lens), bad, side="right")
    return out


def _raw_bytes(arr) -> np.ndarray:
    """The concatenated values of a binary array without nulls, as uint8."""
    bufs, n, o = arr.buffers(), len(arr), arr.offset
    data = bufs[-1]
    if data is None:
        return np.empty(0, np.uint8)
    if arr.type.num_buffers == 2:  # fixed_size_binary: validity, data
        w = arr.type.byte_width
        return np.frombuffer(data, np.uint8)[o * w : (o + n) * w]
    offsets_t = np.int64 if "large" in str(arr.type) else np.int32
    offs = np.frombuffer(bufs[1], offsets_t)[o : o + n + 1]
    return np.frombuffer(data, np.uint8)[offs[0] : offs[-1]]


def resolve(field: Field, path: Path, first: int, batch) -> Column:
    """``field`` as the first training batch (its rows from ``first`` of ``path``) fixes it for
    every row."""
    name = field.feature
    arr = batch.column(name)
    kind = kind_of(arr.type)
    if kind is None:
        raise DataError(
            f"{path}: column {name!r} is {arr.type}; expected numbers: a numeric column, a "
            "flat list of numbers (shaped by --x-shape) or binary raw array bytes"
        )
    value_t = arr.type.value_type if kind == "list" else arr.type
    dtype = np.dtype(field.dtype or ("uint8" if kind == "binary" else value_t.to_pandas_dtype()))
    if dtype.kind not in "uif":
        raise DataError(f"--{field.role}-dtype {dtype}: expected an integer or float type")
    if kind != "binary" and np.dtype(value_t.to_pandas_dtype()).kind == "f" and dtype.kind != "f":
        raise DataError(
            f"{path}: column {name!r} holds {value_t} values; --{field.role}-dtype {dtype} "
            "would round them (give a float type)"
        )
    bad = nulls(kind, arr)
    if len(bad):
        raise DataError(f"{path}: row {first + int(bad[0])}: column {name!r} holds a null")
    count = int(lengths(kind, arr)[0]) // (dtype.itemsize if kind == "binary" else 1)
    if count == 0:
        raise DataError(f"{path}: row {first}: column {name!r} holds no value")
    shape = field.shape
    if shape is None:
        shape = () if field.role == "y" and count == 1 else (count,)
    return Column(field, kind, dtype, shape, str(arr.type))


@dataclass(frozen=True)
class Column(Fixed):
    """A :class:`~.mapping.Field` naming a column, its kind, dtype and shape fixed by the first
    training batch; ``type`` is that column's Arrow type, for messages."""

    type: str = ""

    def describe(self) -> str:
        return f"{self.field.feature} ({self.type}) -> {self.dtype} {shape_text(self.shape)}"

    def extract(self, path: Path, first: int, batch) -> np.ndarray:
        """The rows of ``batch`` (rows ``first``... of ``path``) as ``(n, *shape)`` of this
        dtype, or a refusal naming the file, the row and the column."""
        name = self.field.feature
        arr = batch.column(name)
        kind = kind_of(arr.type)
        if kind != self.kind:
            raise DataError(
                f"{path}: row {first}: column {name!r} is {arr.type}, but the first file's is "
                f"{self.type}"
            )
        bad = nulls(kind, arr)
        if len(bad):
            raise DataError(f"{path}: row {first + int(bad[0])}: column {name!r} holds a null")
        unit = self.dtype.itemsize if kind == "binary" else 1
        lens = lengths(kind, arr)
        wrong = np.flatnonzero(lens != self.count * unit)
        if len(wrong):
            self._refuse_length(path, first + int(wrong[0]), int(lens[wrong[0]]))
        n = len(arr)
        if kind == "binary":
            values = _raw_bytes(arr).view(self.dtype.newbyteorder("<"))
            return values.reshape(n, *self.shape)
        flat = arr.flatten() if kind == "list" else arr
        values = flat.to_numpy(zero_copy_only=False)
        cast, at = cast_exact(values, self.dtype)
        if at is not None:
            raise DataError(
                f"{path}: row {first + at // self.count}: column {name!r} holds {values[at]}, "
                f"which {self.dtype} cannot hold exactly"
            )
        return cast.reshape(n, *self.shape)

    def _refuse_length(self, path: Path, row: int, got: int) -> NoReturn:
        where = f"{path}: row {row}: column {self.field.feature!r}"
        raise wrong_length(where, got, self.kind == "binary", self.shape, self.dtype)
