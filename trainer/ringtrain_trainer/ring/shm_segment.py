"""A same-host link's shared memory: a ``memfd`` segment of slots, created by the receiver and
attached by its left neighbour only when the kernel lets it (the same host, a peer it may trace).

Pipeline position: ``shm.ShmTransport`` offers and attaches segments after the TCP handshake;
this module owns their size (:func:`plan`), creation and attachment.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np

#: Memory per link: at most this many bytes of slots, 2 to 8 slots of one chunk each.
SLOT_BUDGET = 16 << 20
MAX_SLOTS, MIN_SLOTS = 8, 2


_PAGE = mmap.PAGESIZE


def plan(chunk_bytes: int) -> tuple[int, int]:
    """(slots, slot bytes) for a ring of ``chunk_bytes`` chunks: one chunk per slot."""
    slot = -(-chunk_bytes // 64) * 64
    return max(MIN_SLOTS, min(MAX_SLOTS, SLOT_BUDGET // slot)), slot


def _memfd_name(nonce: bytes) -> str:
    return f"ringtrain-{nonce.hex()}"


@dataclass
class Segment:
    """A mapped segment: one page holding the nonce, then ``slots`` slots."""

    mm: mmap.mmap
    slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        self.floats = [
            np.frombuffer(self.mm, np.float32, self.slot_bytes // 4, _PAGE + i * self.slot_bytes)
            for i in range(self.slots)
        ]
        self.bytes = [f.view(np.uint8) for f in self.floats]

    @staticmethod
    def size(slots: int, slot_bytes: int) -> int:
        return _PAGE + slots * slot_bytes


def create(slots: int, slot_bytes: int) -> tuple[Segment, int, bytes]:
    """A new memfd segment with a fresh nonce at its start: (segment, fd, nonce)."""
    nonce = secrets.token_bytes(16)
    fd = os.memfd_create(_memfd_name(nonce))
    try:
        os.ftruncate(fd, Segment.size(slots, slot_bytes))
        mm = mmap.mmap(fd, Segment.size(slots, slot_bytes))
    except OSError:
        os.close(fd)
        raise
    mm[:16] = nonce
    return Segment(mm, slots, slot_bytes), fd, nonce


def attach(pid: int, fd: int, nonce: bytes, slots: int, slot_bytes: int) -> Segment | None:
    """The neighbour's segment, or None where it is not provably the one offered: another
    host, another PID namespace (the pid is someone else here), a descriptor that is not the
    named memfd, a size or nonce that does not match."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != f"/memfd:{_memfd_name(nonce)} (deleted)":
            return None
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(own).st_size != Segment.size(slots, slot_bytes):
            return None
        mm = mmap.mmap(own, Segment.size(slots, slot_bytes))
    except (OSError, ValueError):
        return None
    finally:
        os.close(own)
    if mm[:16] != nonce:
        mm.close()
        return None
    return Segment(mm, slots, slot_bytes)
