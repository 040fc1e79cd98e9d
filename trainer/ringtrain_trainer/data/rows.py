"""Rows of one array spread over many files, read by byte offset into the caller's buffers.

Pipeline position: ``shards.load_sharded`` builds one :class:`ShardedArray` per ``x_train`` /
``x_test``; it stands where an in-memory :class:`~ringtrain_trainer.data.split.Split` holds an
ndarray. The step loop gathers a batch with :meth:`ShardedArray.take_into` (``dataset.batch_into``)
into a preallocated buffer; evaluation slices it (``images[lo:hi]`` is a lazy view, read when
numpy asks for its values), as it slices an ndarray.

Why ``os.preadv`` and not ``np.load(mmap_mode="r")``: pages read through a mapping count in the
process's resident set (``RssFile``) until the kernel needs them back, so an epoch over a
mapped data set grows the worker's RSS to the data set's size whenever the node has memory to
spare — exactly what a pod's memory limit and our bound forbid. ``preadv`` copies the rows
into buffers the worker already owns; the file pages stay in the page cache, which the
kernel reclaims and which is not the process's RSS. A run of consecutive rows of one file is
one system call scattering into the batch's slots (the batch reads grouped by file and
sorted by offset), and the call releases the GIL, so a background thread reads while the
step computes (``feed``).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import DataError

#: the most buffers one ``preadv`` takes (Linux's IOV_MAX)
IOV_MAX = 1024


@dataclass(frozen=True)
class Part:
    """``rows`` rows of the array, stored C-ordered from byte ``offset`` of ``path``
    (``member``: the ``.npz`` member or the ``.npy`` array's key, for messages)."""

    path: str
    member: str
    offset: int
    rows: int


class _Files:
    """The parts of one array and their open descriptors (shared by every view of it)."""

    def __init__(self, parts: list[Part], row_bytes: int):
        self.parts = parts
        self.row_bytes = row_bytes
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.rows)
        self.fds: list[int] = []
        for p in parts:
            try:
                self.fds.append(os.open(p.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            except OSError as e:
                self.close()
                raise DataError(f"{p.path}: cannot open ({e.strerror})") from None

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def where(self, i: int) -> tuple[int, int]:
        """(part, byte offset in its file) of global row ``i``."""
        p = bisect.bisect_right(self.starts, i) - 1
        return p, self.parts[p].offset + (i - self.starts[p]) * self.row_bytes

    def read(self, p: int, offset: int, bufs: list) -> None:
        want = sum(len(b) for b in bufs)
        got = os.preadv(self.fds[p], bufs, offset)
        if got != want:
            if got < want and len(bufs) == 1 and got > 0:  # a large read may come in pieces
                self.read(p, offset + got, [bufs[0][got:]])
                return
            part = self.parts[p]
            raise DataError(
                f"{part.path}: {part.member}: short read at byte {offset} "
                f"({got} of {want} bytes): the file changed or is truncated"
            )


class ShardedArray:
    """A read-only ``(n, *row_shape)`` array of ``dtype`` whose rows live in several files.

    What the trainer asks of an ndarray it answers: ``shape``, ``dtype``, ``ndim``, ``len``,
    slicing with step 1 (a lazy view), ``np.asarray`` (reads the rows) and ``reshape`` (of the
    read rows); :meth:`take_into` is the batch gather."""

    def __init__(
        self,
        parts: list[Part],
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        _files: _Files | None = None,
        _range: tuple[int, int] | None = None,
    ):
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        self._files = _files if _files is not None else _Files(parts, row_bytes)
        self.lo, self.hi = _range if _range is not None else (0, self._files.starts[-1])
        self.shape = (self.hi - self.lo, *self.row_shape)
        self.ndim = len(self.shape)

    @property
    def parts(self) -> list[Part]:
        return self._files.parts

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self._files.row_bytes

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ShardedArray({self.dtype} {self.shape}, {len(self.parts)} files)"

    def close(self) -> None:
        self._files.close()

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            return np.asarray(self[i : i + 1])[0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a ShardedArray is sliced by row ranges only; gather with take_into")
        lo, hi, _ = key.indices(len(self))
        hi = max(lo, hi)
        return ShardedArray(
            [], self.row_shape, self.dtype, self._files, (self.lo + lo, self.lo + hi)
        )

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.read_into(0, len(self), out)
        return out if dtype is None else out.astype(dtype, copy=False)

    def reshape(self, *shape) -> np.ndarray:
        return np.asarray(self).reshape(*shape)

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows ``start:stop`` of this view into ``out`` (C-contiguous, this dtype)."""
        f, flat = self._files, _bytes(out, stop - start, self._files.row_bytes)
        i, j = self.lo + start, 0
        while i < self.lo + stop:
            p, offset = f.where(i)
            n = min(self.lo + stop, f.starts[p + 1]) - i
            f.read(p, offset, [flat[j : j + n].reshape(-1)])
            i, j = i + n, j + n

    def take_into(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Rows ``idx`` (of this view) into ``out[k]`` for each ``k``: the reads sorted by file
        and offset, each run of consecutive rows of one file one ``preadv`` scattering into its
        slots of ``out``."""
        f, flat = self._files, _bytes(out, len(idx), self._files.row_bytes)
        order = np.argsort(idx, kind="stable")
        k, n = 0, len(order)
        while k < n:
            first = int(idx[order[k]]) + self.lo
            p, offset = f.where(first)
            end = f.starts[p + 1]
            bufs = [flat[order[k]]]
            row = first
            k += 1
            while k < n and len(bufs) < IOV_MAX:
                nxt = int(idx[order[k]]) + self.lo
                if nxt != row + 1 or nxt >= end:
                    break
                bufs.append(flat[order[k]])
                row = nxt
                k += 1
            f.read(p, offset, bufs)

    def chunks(self, rows: int):
        """The rows in ndarrays of up to ``rows`` (a load-time scan, one buffer reused)."""
        buf = np.empty((min(rows, max(1, len(self))), *self.row_shape), self.dtype)
        for s in range(0, len(self), rows):
            n = min(rows, len(self) - s)
            self.read_into(s, s + n, buf[:n])
            yield buf[:n]


def _bytes(out: np.ndarray, n: int, row_bytes: int) -> np.ndarray:
    """``out`` as ``(n, row_bytes)`` uint8 rows sharing its memory (the read targets)."""
    if not out.flags.c_contiguous or out.nbytes != n * row_bytes:
        raise ValueError(f"buffer {out.dtype} {out.shape} is not {n} contiguous rows")
    return out.reshape(-1).view(np.uint8).reshape(n, row_bytes)
