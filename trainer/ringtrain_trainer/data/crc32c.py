"""CRC-32C (Castagnoli) of many byte ranges at once, in numpy: TFRecord's checksums.

Pipeline position: :mod:`.tfrecord` verifies every record's two checksums (of its length and
of its data) through :func:`masked_many`, one call per block of records.

Why not a package: no CRC-32C package is in the lock (``google-crc32c``, ``crc32c``), and a
byte-at-a-time loop in Python checks about 1 MB/s — a minute for Fashion-MNIST as TFRecord.
The CRC is a linear map over GF(2), which numpy can exploit twice:

* across ranges: many ranges advance one byte per numpy operation, each range its own lane
  (the classic table lookup ``reg = (reg >> 8) ^ T[(reg ^ byte) & 0xff]`` on arrays). A range
  is cut into pieces of at most :data:`PIECE` bytes, each piece a lane, front-padded with zero
  bytes to its bucket's width — leading zeros leave a register that starts at 0 at 0;
* then the pieces of one range are joined: a register run from 0 over ``A || B`` is
  ``shift(reg(A), len(B)) ^ reg(B)``, where ``shift`` (running ``len(B)`` zero bytes) is
  linear, applied as four 256-entry tables per power of two of the length. The standard
  initial value and final xor are folded in the same way.

Measured on 2 shared cores: 40-60 MB/s for ranges of 850 bytes to 1 MiB (decision 0215).
"""

from __future__ import annotations

import numpy as np

#: CRC-32C's polynomial, bit-reflected
POLY = 0x82F63B78
#: the longest piece one lane runs over; longer ranges are cut and joined by ``shift``
PIECE = 2048
#: at most this many bytes (lanes x width) are gathered into one padded matrix
MATRIX_BYTES = 1 << 20
#: TFRecord's mask constant (``masked_crc32c`` in tensorflow/core/lib/hash/crc32c.h)
MASK_DELTA = 0xA282EAD8


def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


TABLE = _table()


def _apply(tabs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The linear map given by ``tabs`` (4 x 256: its value on each byte of the word) on ``x``."""
    return (
        tabs[0][x & 0xFF] ^ tabs[1][(x >> 8) & 0xFF] ^ tabs[2][(x >> 16) & 0xFF] ^ tabs[3][x >> 24]
    )


def _shift_tables() -> np.ndarray:
    """``[k]``: the tables of running ``2**k`` zero bytes through the register, k < 40."""
    v = np.arange(256, dtype=np.uint32)
    words = np.stack([v << np.uint32(8 * j) for j in range(4)])
    one = (words >> 8) ^ TABLE[words & 0xFF]  # one zero byte
    out = [one]
    for _ in range(39):
        prev = out[-1]
        out.append(np.stack([_apply(prev, _apply(prev, w)) for w in words]))
    return np.stack(out).astype(np.uint32)


SHIFT = _shift_tables()


def shift(reg: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Each register of ``reg`` run over ``n`` (per element) zero bytes."""
    reg = np.array(reg, dtype=np.uint32)
    n = np.asarray(n, dtype=np.int64)
    k = 0
    while k < len(SHIFT) and (n >> k).any():
        sel = ((n >> k) & 1).astype(bool)
        if sel.any():
            reg[sel] = _apply(SHIFT[k], reg[sel])
        k += 1
    return reg


def _lanes(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The register run from 0 over each range (all of at most the same small width)."""
    width = int(lens.max()) if len(lens) else 0
    reg = np.zeros(len(starts), np.uint32)
    if width == 0:
        return reg
    cols = np.arange(width, dtype=np.int64)
    pad = width - lens
    # (width, lanes): column c of lane i is byte starts[i] + c - pad[i], or a leading zero
    idx = starts[None, :] + cols[:, None] - pad[None, :]
    valid = cols[:, None] >= pad[None, :]
    grid = np.where(valid, buf[np.where(valid, idx, 0)], 0).astype(np.uint32)
    for c in range(width):
        reg = (reg >> 8) ^ TABLE[(reg ^ grid[c]) & 0xFF]
    return reg


def _raw_many(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The register run from 0 over each range ``buf[starts[i]:starts[i] + lens[i]]``."""
    pieces = (lens + PIECE - 1) // PIECE
    owner = np.repeat(np.arange(len(lens)), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(len(owner)) - first[owner]  # the piece's number within its range
    p_start = starts[owner] + k * PIECE
    p_len = np.minimum(PIECE, lens[owner] - k * PIECE)
    after = lens[owner] - k * PIECE - p_len  # bytes of the range after the piece
    reg = np.zeros(len(owner), np.uint32)
    # pieces bucketed by the power of two above their length, so padding at most doubles work
    bucket = np.ceil(np.log2(np.maximum(p_len, 1))).astype(np.int64)
    for b in np.unique(bucket):
        sel = np.flatnonzero(bucket == b)
        per = max(1, MATRIX_BYTES // max(1, 1 << int(b)))
        for s in range(0, len(sel), per):
            part = sel[s : s + per]
            reg[part] = _lanes(buf, p_start[part], p_len[part])
    out = np.zeros(len(lens), np.uint32)
    np.bitwise_xor.at(out, owner, shift(reg, after))
    return out


def crc32c_many(buf, starts, lens) -> np.ndarray:
    """CRC-32C of each range ``buf[starts[i]:starts[i] + lens[i]]`` (uint32 array)."""
    buf = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
    starts = np.asarray(starts, np.int64)
    lens = np.asarray(lens, np.int64)
    ones = np.full(len(lens), 0xFFFFFFFF, np.uint32)
    return _raw_many(buf, starts, lens) ^ shift(ones, lens) ^ ones


def crc32c(data: bytes) -> int:
    return int(crc32c_many(data, [0], [len(data)])[0])


def mask(crc: np.ndarray) -> np.ndarray:
    """TFRecord's masked CRC: rotated right by 15 bits, plus :data:`MASK_DELTA` (mod 2**32)."""
    crc = np.asarray(crc, np.uint32)
    rot = (crc >> np.uint32(15)) | (crc << np.uint32(17))
    return ((rot.astype(np.uint64) + MASK_DELTA) & 0xFFFFFFFF).astype(np.uint32)


def masked_many(buf, starts, lens) -> np.ndarray:
    return mask(crc32c_many(buf, starts, lens))
