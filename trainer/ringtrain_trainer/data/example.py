"""``tf.train.Example`` decoded from protobuf's wire format, without TensorFlow or protoc.

Pipeline position: :mod:`.tfrecord` yields each record's bytes; :func:`decode` turns them into
``{feature name: Feature}``; :mod:`.mapping` picks the model's inputs and labels out of them.

The messages (tensorflow/core/example/example.proto, feature.proto)::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }  // { string key = 1; Feature value = 2; }
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                            Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

A parser must accept both encodings of a repeated number (packed, as TensorFlow writes them,
and one field per value, which other writers may emit), concatenate repeated occurrences, let
the last of a oneof or a map key win, and skip fields it does not know — as protobuf's own
parsers do. The packed lists, where the values are, decode in numpy (varints by their
terminating bytes); the per-record walk is a few µs of Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("bytes_list", "float_list", "int64_list")
#: packed varint lists up to this many bytes are decoded in Python, longer ones in numpy
SHORT_PACKED = 32
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a valid ``tf.train.Example``; the message says where."""


@dataclass
class Feature:
    """One feature's values: ``kind`` is one of :data:`KINDS` (None: a Feature with no kind,
    no values); ``values`` a list of bytes, a float32 or an int64 array."""

    kind: str | None
    values: list[bytes] | np.ndarray

    def __len__(self) -> int:
        return len(self.values)


def _varint(buf, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("a varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, pos
        shift += 7
        if shift >= 70:
            raise WireError("a varint longer than 10 bytes")


def _fields(buf):
    """(field number, wire type, value) of each field: an int for varints and fixed numbers,
    the bytes of a length-delimited field."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == VARINT:
            value, pos = _varint(buf, pos)
        elif wire == LEN:
            size, pos = _varint(buf, pos)
            if pos + size > n:
                raise WireError(f"field {number}: {size} bytes run past the end of its message")
            value, pos = buf[pos : pos + size], pos + size
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            if pos + width > n:
                raise WireError(f"field {number}: a fixed-width value past the end")
            value, pos = buf[pos : pos + width], pos + width
        else:
            raise WireError(f"field {number}: wire type {wire} (groups) is not in an Example")
        yield number, wire, value


def packed_varints(buf) -> np.ndarray:
    """The int64 values of a packed run of varints (two's complement, as int64 is encoded)."""
    if len(buf) <= SHORT_PACKED:  # a label or two: numpy's overhead would dominate
        out, pos = [], 0
        while pos < len(buf):
            v, pos = _varint(buf, pos)
            out.append(v & 0xFFFFFFFFFFFFFFFF)  # as int64 wraps
        return np.array(out, np.uint64).view(np.int64)
    b = np.frombuffer(buf, np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) == 0 or ends[-1] != len(b) - 1:
        raise WireError("a packed int64 list ends inside a varint")
    starts = np.concatenate(([0], ends[:-1] + 1))
    if (ends - starts).max() >= 10:
        raise WireError("a varint longer than 10 bytes")
    owner = np.repeat(np.arange(len(ends)), ends - starts + 1)
    place = np.arange(len(b)) - starts[owner]
    parts = (b & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts).view(np.int64)


def _list(kind: str, buf) -> list[bytes] | np.ndarray:
    if kind == "bytes_list":
        return [bytes(v) for num, wire, v in _fields(buf) if num == 1 and wire == LEN]
    chunks: list[np.ndarray] = []
    for num, wire, v in _fields(buf):
        if num != 1:
            continue
        if kind == "float_list":
            if wire == LEN:
                if len(v) % 4:
                    raise WireError(f"a packed float list of {len(v)} bytes")
                chunks.append(np.frombuffer(v, "<f4"))
            elif wire == FIXED32:
                chunks.append(np.frombuffer(v, "<f4"))
            else:
                raise WireError(f"a float list value has wire type {wire}")
        elif wire == LEN:
            chunks.append(packed_varints(v))
        elif wire == VARINT:
            chunks.append(np.array([v], np.uint64).view(np.int64))
        else:
            raise WireError(f"an int64 list value has wire type {wire}")
    dtype = np.float32 if kind == "float_list" else np.int64
    if not chunks:
        return np.zeros(0, dtype)
    return np.concatenate(chunks).astype(dtype)


def _feature(buf) -> Feature:
    out = Feature(None, [])
    for num, wire, v in _fields(buf):
        if 1 <= num <= 3 and wire == LEN:
            kind = KINDS[num - 1]
            values = _list(kind, v)
            if out.kind == kind:  # a repeated sub-message merges: its lists concatenate
                values = (
                    out.values + values
                    if isinstance(out.values, list) and isinstance(values, list)
                    else np.concatenate([out.values, values])
                )
            out = Feature(kind, values)
    return out


def decode(record: bytes | memoryview) -> dict[str, Feature]:
    """The features of one serialized ``tf.train.Example`` (raises :class:`WireError`)."""
    out: dict[str, Feature] = {}
    for num, wire, features in _fields(memoryview(record)):  # slices of it copy nothing
        if num != 1 or wire != LEN:
            continue
        for fnum, fwire, entry in _fields(features):
            if fnum != 1 or fwire != LEN:
                continue
            key, value = "", Feature(None, [])
            for enum, ewire, v in _fields(entry):
                if enum == 1 and ewire == LEN:
                    try:
                        key = bytes(v).decode("utf-8")
                    except UnicodeDecodeError:
                        raise WireError(f"a feature name is not UTF-8: {bytes(v)!r}") from None
                elif enum == 2 and ewire == LEN:
                    value = _feature(v)
            out[key] = value
    return out
