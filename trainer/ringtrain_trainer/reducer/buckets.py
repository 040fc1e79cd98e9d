"""Bucket readiness: which gradient buckets are complete, given the pieces streamed so far.

Pure bookkeeping, no threads. Like PyTorch DDP, bucket assignment is a pure function of the
sizes in arrival order and a byte cap, with a small first bucket so communication starts
early. The sizes are the model's own streamed pieces (``ModelSpec.param_pieces``): a bucket
never splits a piece, so every bucket ends exactly where a streamed piece ends. Because
parameters are laid out in reverse layer order, every bucket is a contiguous slice of the flat
gradient buffer, reduced in place without packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from ringtrain import options

#: DDP's default cap, 25 MiB buckets: the table's ``bucket_mb``.
DEFAULT_BUCKET_BYTES = int(options.DEFAULTS["bucket_mb"] * (1 << 20))
#: the first bucket's cap. DDP uses 1 MiB, sized for models of hundreds of MB; the cnn's
#: gradients are 1.39 MB in all, so 1 MiB would hold back three quarters of them (measured:
#: 256 KiB hides more of the allreduce, see docs/trainer.md)
FIRST_BUCKET_BYTES = 256 << 10


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int
    stop: int
    params: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def assign_buckets(
    params: Sequence[int | Sequence[int]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    itemsize: int = 4,
) -> list[Bucket]:
    """Group streamed pieces into buckets; ``params`` holds, per parameter in arrival order,
    the sizes (elements) of the pieces it streams in, or one size for a parameter streamed
    whole.

    DDP's rule: add pieces to the open bucket until its bytes reach the cap, then close it;
    the first bucket's cap is ``min(first_bucket_bytes, bucket_bytes)``. A piece is never
    split (a bucket may end mid-parameter: the optimizer works element by element), and the
    last piece of a parameter streamed in several pieces closes its bucket: the next layer's
    gradients come later, after backward has moved on, and would otherwise hold the finished
    pieces back.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    start = offset = 0
    members: list[int] = []
    for i, p in enumerate(params):
        sizes = list(cast("Sequence[int]", p)) if hasattr(p, "__len__") else [int(p)]
        for k, n in enumerate(sizes or [0]):
            if not members or members[-1] != i:
                members.append(i)
            offset += n
            cap = min(first_bucket_bytes, bucket_bytes) if not buckets else bucket_bytes
            if (offset - start) * itemsize >= cap or (len(sizes) > 1 and k == len(sizes) - 1):
                buckets.append(Bucket(len(buckets), start, offset, tuple(members)))
                start, members = offset, []
    if members:
        buckets.append(Bucket(len(buckets), start, offset, tuple(members)))
    return buckets


class Readiness:
    """Counts the elements still missing per bucket this step and releases complete buckets
    strictly in order: the same order on every rank (the contract of ``collective``)."""

    def __init__(self, buckets: Sequence[Bucket]):
        self.buckets = list(buckets)
        self._remaining = [b.size for b in self.buckets]
        self._next = 0

    def reset(self) -> None:
        self._next = 0
        for i, b in enumerate(self.buckets):
            self._remaining[i] = b.size

    def add(self, start: int, stop: int) -> range:
        """Gradients [start, stop) are final; returns the indices of buckets now ready."""
        for i in range(self._next, len(self.buckets)):
            b = self.buckets[i]
            lo, hi = max(start, b.start), min(stop, b.stop)
            if lo < hi:
                self._remaining[i] -= hi - lo
        first = self._next
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._next += 1
        return range(first, self._next)

    @property
    def launched(self) -> int:
        return self._next
