"""TFRecord files read without TensorFlow: the framing, every checksum verified.

Pipeline position: ``ringtrain data inspect`` and ``ringtrain data convert`` (:mod:`.convert`)
read TFRecord files through :func:`blocks`; :mod:`.example` decodes each record's
``tf.train.Example``. The trainer itself never reads TFRecord: it trains from the ``.npy``
shards ``convert`` writes (decision 0215).

A record is framed as TensorFlow's ``RecordWriter`` writes it
(tensorflow/core/lib/io/record_writer.cc)::

    uint64 length (little endian) | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)

Records are read in blocks of about :data:`BLOCK_BYTES`, the framing walked in Python (a few
µs per record), the block's checksums verified at once in numpy (:mod:`.crc32c`). A corrupt or
truncated record is refused naming the file and the record's index in it (counted from 0, as
``tf.data.TFRecordDataset`` yields them); a length whose checksum fails is reported as such
before anything is read by it. Files written with ``options="GZIP"`` are read through
:mod:`gzip` (recognised by its magic bytes); ZLIB-compressed files are not recognised.
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.crc32c import masked_many
from ringtrain_trainer.data.example import Feature, WireError, decode
from ringtrain_trainer.data.sources import listed_files

#: bytes read per block (records longer than this get a block of their own)
BLOCK_BYTES = 8 << 20
HEADER = 12  # length + its checksum
FOOTER = 4  # the data's checksum
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class Block:
    """Records ``first``, ``first + 1``, ... of ``path``: record ``i`` of the block is
    ``buf[starts[i]:starts[i] + lens[i]]``."""

    path: Path
    first: int
    buf: np.ndarray
    starts: np.ndarray
    lens: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def record(self, i: int) -> memoryview:
        s = int(self.starts[i])
        return memoryview(self.buf.data)[s : s + int(self.lens[i])]


def _open(path: Path):
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == GZIP_MAGIC
        return gzip.open(path, "rb") if gz else open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None


def looks_like_tfrecord(path: Path) -> bool:
    """Whether ``path`` starts with a TFRecord frame (its length's checksum holds), or is a
    gzip file named as TFRecord. An empty file holds no records and is not recognised."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
    except OSError:
        return False
    if head[:2] == GZIP_MAGIC:
        return ".tfrecord" in path.name or path.name.endswith(".tfr")
    if len(head) < HEADER:
        return False
    return _length_ok(head, 0)


def _check(
    path: Path, first: int, buf: np.ndarray, heads: list[int], lens: list[int], offset: int = 0
) -> None:
    """Verify the checksums of the records framed at ``heads`` (``lens`` data bytes each) of a
    block starting at byte ``offset`` of the file."""
    if not heads:
        return
    h = np.asarray(heads, np.int64)
    n = np.asarray(lens, np.int64)
    stored_len = buf[(h + 8)[:, None] + np.arange(4)].copy().view("<u4").reshape(-1)
    stored_data = buf[(h + HEADER + n)[:, None] + np.arange(4)].copy().view("<u4").reshape(-1)
    bad_len = masked_many(buf, h, np.full(len(h), 8)) != stored_len
    bad_data = masked_many(buf, h + HEADER, n) != stored_data
    bad = np.flatnonzero(bad_len | bad_data)
    if len(bad):
        i = int(bad[0])
        what = "its length's" if bad_len[i] else "its data's"
        raise DataError(
            f"{path}: record {first + i}: {what} checksum does not match (the record "
            f"starts at byte {offset + heads[i]}): the file is corrupt"
        )


def _length_ok(data: bytes, pos: int) -> bool:
    want = struct.unpack_from("<I", data, pos + 8)[0]
    return int(masked_many(np.frombuffer(data, np.uint8), [pos], [8])[0]) == want


def _fill(f, size: int) -> bytes:
    out = f.read(size)
    return out if isinstance(out, bytes) else bytes(out)


def blocks(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """The records of one TFRecord file, a block at a time, every checksum verified."""
    path = Path(path)
    with _open(path) as f:
        carry = b""
        first = 0
        offset = 0  # the file (or stream) offset of carry's first byte, for messages
        while True:
            chunk = _fill(f, block_bytes)
            data = carry + chunk
            at_end = len(chunk) < block_bytes
            heads: list[int] = []
            lens: list[int] = []
            pos = 0
            while len(data) - pos >= HEADER:
                (length,) = struct.unpack_from("<Q", data, pos)
                end = pos + HEADER + length + FOOTER
                if end > len(data):
                    if not _length_ok(data, pos):  # never read by a length that is corrupt
                        _check(path, first, np.frombuffer(data, np.uint8), heads, lens, offset)
                        raise DataError(
                            f"{path}: record {first + len(heads)}: its length's checksum does "
                            "not match: the file is corrupt"
                        )
                    if at_end:
                        raise DataError(
                            f"{path}: record {first + len(heads)}: truncated (needs {length} "
                            f"data bytes, the file ends {len(data) - pos - HEADER} bytes on)"
                        )
                    if pos:
                        break  # the rest comes with the next block
                    more = _fill(f, end - len(data))  # a record longer than a block
                    at_end = len(more) < end - len(data)
                    data += more
                    continue
                heads.append(pos)
                lens.append(length)
                pos = end
            if at_end and pos < len(data):
                raise DataError(
                    f"{path}: record {first + len(heads)}: truncated ({len(data) - pos} bytes "
                    f"at byte {offset + pos}, less than a record's {HEADER}-byte header)"
                )
            buf = np.frombuffer(data, np.uint8)
            _check(path, first, buf, heads, lens, offset)
            if heads:
                starts = np.asarray(heads, np.int64) + HEADER
                yield Block(path, first, buf, starts, np.asarray(lens, np.int64))
            first += len(heads)
            offset += pos
            carry = data[pos:]
            if at_end:
                return


def records(path: str | os.PathLike) -> Iterator[tuple[int, memoryview]]:
    """(index, data) of every record of ``path``, in order."""
    for b in blocks(path):
        for i in range(len(b)):
            yield b.first + i, b.record(i)


def examples(path: Path) -> Iterator[tuple[Path, int, dict[str, Feature]]]:
    """(path, index, decoded ``tf.train.Example`` features) of every record of ``path``."""
    for block in blocks(path):
        for i in range(len(block)):
            try:
                features = decode(block.record(i))
            except WireError as e:
                raise DataError(
                    f"{path}: record {block.first + i}: not a tf.train.Example ({e})"
                ) from None
            yield path, block.first + i, features


def tfrecord_files(path: str | os.PathLike) -> list[Path] | None:
    """The TFRecord files ``path`` names, sorted: a file, a directory's own files that start
    with a TFRecord frame (:func:`looks_like_tfrecord`) or a glob's; None when it names none."""
    found = [f for f in listed_files(path) if looks_like_tfrecord(f)]
    return found or None
