"""Which ``tf.train.Example`` features are the model's inputs and labels, checked per record.

Pipeline position: ``ringtrain data convert`` (:mod:`.convert`) is given the mapping on its
command line (``--x FEATURE [--x-shape 28,28] [--x-dtype uint8] --y FEATURE``); each record's
decoded features (:mod:`.example`) pass through :meth:`Resolved.extract` into one row of the
``x_*`` / ``y_*`` shards. The first record fixes what every other record must hold; the
shards' fit to the model is then checked by the trainer as for any shards (``check_fits``).

How a feature becomes a row, as TensorFlow's own parsing reads it:

* ``bytes_list`` of one value: the example's raw bytes (``tf.io.decode_raw(v, dtype)``, little
  endian), ``--x-dtype`` their type (default uint8). Encoded images (PNG, JPEG) are not decoded.
* ``float_list``: float32 values (``FixedLenFeature(shape, tf.float32)``); a float dtype may be
  asked for.
* ``int64_list``: int64 values (``FixedLenFeature(shape, tf.int64)``); a narrower dtype (uint8
  pixels, int32 ids) may be asked for and every value must fit it exactly.

``--x-shape`` reshapes the values (default: flat, as many as the first record holds); a label
of one value is a scalar per example (a class id). Anything else — a missing feature, another
kind than the first record's, another count of values, a value the dtype cannot hold — is
refused naming the file, the record's index and the feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NoReturn

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.example import Feature

DEFAULT_DTYPE = {"bytes_list": "uint8", "float_list": "float32", "int64_list": "int64"}


def parse_shape(text: str, flag: str = "--x-shape") -> tuple[int, ...]:
    """``"28,28"`` → (28, 28); ``""`` or ``"()"`` → () (a scalar per example)."""
    t = text.strip().strip("()")
    try:
        shape = tuple(int(s) for s in t.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a shape (sizes: 28,28)") from None
    if any(s <= 0 for s in shape):
        raise ValueError(f"{flag} {text!r}: every size must be positive")
    return shape


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "a scalar"


def cast_exact(values: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, int | None]:
    """``values`` as ``dtype``, and the index of the first integer the cast changed (None when
    none did). Floats are cast as asked (a float type's rounding is the user's choice); the
    callers never cast floats into integers."""
    if values.dtype == dtype:
        return values, None
    cast = values.astype(dtype)
    if values.dtype.kind in "iu" and not np.array_equal(cast, values):
        return cast, int(np.flatnonzero(cast != values)[0])
    return cast, None


@dataclass(frozen=True)
class Field:
    """What the user stated: array ``role`` ("x" or "y") is feature ``feature``, stored as
    ``dtype`` in ``shape`` per example (None: from the first record, see the module)."""

    role: str
    feature: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def resolve(self, path: Path, index: int, features: dict[str, Feature]) -> Resolved:
        """This field as the first record (``index`` of ``path``) fixes it for every record."""
        f = _present(path, index, self.feature, features)
        if f.kind is None:
            raise DataError(f"{path}: record {index}: feature {self.feature!r} holds no list")
        dtype = np.dtype(self.dtype or DEFAULT_DTYPE[f.kind])
        if dtype.kind not in "uif":
            raise DataError(f"--{self.role}-dtype {dtype}: expected an integer or float type")
        if f.kind == "float_list" and dtype.kind != "f":
            raise DataError(
                f"{path}: record {index}: feature {self.feature!r} is a float_list; "
                f"--{self.role}-dtype {dtype} would round it (give a float type)"
            )
        if f.kind == "bytes_list":
            _raw(path, index, self.feature, f)
            count = len(f.values[0]) // dtype.itemsize
        else:
            count = len(f)
        shape = self.shape
        if shape is None:
            shape = () if self.role == "y" and count == 1 else (count,)
        return Resolved(self, f.kind, dtype, shape)


def _present(path: Path, index: int, name: str, features: dict[str, Feature]) -> Feature:
    if name not in features:
        have = ", ".join(sorted(features)) or "none"
        raise DataError(f"{path}: record {index}: no feature {name!r} (it has: {have})")
    return features[name]


def _raw(path: Path, index: int, name: str, f: Feature) -> None:
    if len(f) != 1:
        raise DataError(
            f"{path}: record {index}: feature {name!r} holds {len(f)} byte strings; expected "
            "one (an example's raw array bytes)"
        )


@dataclass(frozen=True)
class Fixed:
    """A :class:`Field` with its kind, dtype and shape fixed by the first item read (a TFRecord
    record, a Parquet batch)."""

    field: Field
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @cached_property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Resolved(Fixed):
    """A TFRecord feature's :class:`Fixed` mapping, applied record by record."""

    @cached_property
    def _little(self) -> np.dtype:
        return self.dtype.newbyteorder("<")

    def describe(self) -> str:
        return f"{self.field.feature} ({self.kind}) -> {self.dtype} {shape_text(self.shape)}"

    def extract(self, path: Path, index: int, features: dict[str, Feature], out: np.ndarray):
        """Record ``index``'s value of this field into ``out`` (one row: this dtype and shape).
        Once per record and field: messages are formatted only when refusing."""
        f = features.get(self.field.feature)
        if (
            f is None
            or f.kind != self.kind
            or len(f) != (1 if self.kind == "bytes_list" else self.count)
        ):
            self._refuse(path, index, features)
        if self.kind == "bytes_list":
            raw = f.values[0]
            if len(raw) != self.count * self.dtype.itemsize:
                self._refuse(path, index, features)
            out[...] = np.frombuffer(raw, self._little).reshape(self.shape)
            return
        values = f.values
        assert isinstance(values, np.ndarray)  # a float_list's or int64_list's
        cast, at = cast_exact(values, self.dtype)
        if at is not None:
            where = f"{path}: record {index}: feature {self.field.feature!r}"
            raise DataError(f"{where} holds {values[at]}, which {self.dtype} cannot hold exactly")
        out[...] = cast.reshape(self.shape)

    def _refuse(self, path: Path, index: int, features: dict[str, Feature]) -> NoReturn:
        name = self.field.feature
        f = _present(path, index, name, features)
        where = f"{path}: record {index}: feature {name!r}"
        if f.kind != self.kind:
            raise DataError(f"{where} is a {f.kind}, but the first record's is a {self.kind}")
        if self.kind == "bytes_list":
            _raw(path, index, name, f)
        raw = self.kind == "bytes_list"
        got = len(f.values[0]) if raw else len(f)
        raise wrong_length(where, got, raw, self.shape, self.dtype)


def wrong_length(
    where: str, got: int, raw: bool, shape: tuple[int, ...], dtype: np.dtype
) -> DataError:
    """The refusal of an example holding ``got`` values (bytes, when ``raw``) for ``shape``."""
    count = int(np.prod(shape, dtype=np.int64))
    want = f"{count} ({shape_text(shape)} {dtype})"
    if raw:
        return DataError(
            f"{where} holds {got} bytes; expected {count * dtype.itemsize} = {want} values of "
            f"{dtype.itemsize} bytes (raw array bytes; encoded images are not decoded)"
        )
    return DataError(f"{where} holds {got} values; expected {want}")
