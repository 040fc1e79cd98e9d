"""What precedes each collective on the wire: a fixed 40-byte header naming the operation.

Both transports send it before the tensor bytes (the raw TCP stream in-band, gRPC as binary
metadata), so a receiver can compare it with the collective it is itself executing and refuse a
peer that is on another step, another bucket or another tensor size *before* a single byte of
that peer's data reaches the buffer.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"RTR1"
_HEADER = struct.Struct("!4sBxHQqqQ")
HEADER_BYTES = _HEADER.size


class Kind(enum.IntEnum):
    ALLREDUCE = 1
    BROADCAST = 2
    #: an allreduce of float16 values (``--allreduce-dtype float16``): half the bytes; a kind
    #: of its own so that a peer reducing float32 at that position is refused, never mixed in
    ALLREDUCE_F16 = 3


class Mismatch(enum.Enum):
    """Why a header was refused; the gRPC transport maps these to status codes."""

    MALFORMED = "malformed"
    SEQUENCE = "sequence"  # another collective (peer ahead/behind or a replay)
    STEP = "step"  # same collective position but another training step or bucket
    SIZE = "size"  # same collective, different tensor size or root


@dataclass(frozen=True)
class OpHeader:
    """One collective: ``seq`` counts collectives on this ring (identical on every rank because
    calls happen in the same order everywhere); ``step``/``tag`` are the caller's training step
    and bucket; ``nelem`` the float32 element count; ``root`` the broadcast root."""

    kind: Kind
    seq: int
    step: int
    tag: int
    nelem: int
    root: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, int(self.kind), self.root, self.seq, self.step, self.tag, self.nelem
        )

    @classmethod
    def unpack(cls, data: bytes) -> OpHeader | None:
        """Parse a header; ``None`` when it is not one (wrong length, magic or kind)."""
        if len(data) != HEADER_BYTES:
            return None
        magic, kind, root, seq, step, tag, nelem = _HEADER.unpack(data)
        if magic != MAGIC or kind not in Kind._value2member_map_:
            return None
        return cls(Kind(kind), seq, step, tag, nelem, root)

    def mismatch(self, expected: OpHeader) -> Mismatch | None:
        """How this (received) header differs from the collective the receiver is running."""
        if self.seq != expected.seq or self.kind != expected.kind:
            return Mismatch.SEQUENCE
        if self.step != expected.step or self.tag != expected.tag:
            return Mismatch.STEP
        if self.nelem != expected.nelem or self.root != expected.root:
            return Mismatch.SIZE
        return None

    def describe(self) -> str:
        return (
            f"{self.kind.name.lower()} #{self.seq} step {self.step} tag {self.tag} "
            f"of {self.nelem} {'float16' if self.kind == Kind.ALLREDUCE_F16 else 'float32'}"
            + (f" root {self.root}" if self.kind == Kind.BROADCAST else "")
        )
