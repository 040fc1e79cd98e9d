"""The ring's chunk schedule: which element ranges each rank sends and receives, as pure data.

Kept apart from any socket so that the algorithm can be checked exhaustively in memory (any N,
any size, sizes not divisible by N, empty segments) and so that every transport follows exactly
the same plan. Reduce-scatter then allgather (Patarasuk & Yuan 2009): the buffer is cut into N
segments; in reduce-scatter step s rank r sends segment r-s and adds the segment r-s-1 it
receives from its left neighbour; after N-1 steps rank r holds the full sum of segment r+1,
which allgather passes around the ring in N-1 more steps. The segment a rank receives in one
phase is the one it sends in the next, so a chunk can be forwarded the moment it has been
reduced: that is what lets the transport pipeline at chunk granularity.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes per chunk on the wire unless the caller asks otherwise (TensorFlow aims at ≤ 4 MiB).
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Phase:
    """One step of the ring on one rank: send segment ``send``, receive segment ``recv``.

    ``reduce`` says whether the received data is added (reduce-scatter) or copied (allgather).
    """

    send: int
    recv: int
    reduce: bool


def segment_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``size`` contiguous segments whose lengths differ by at most one.

    The first ``n % size`` segments get the extra element (like ``numpy.array_split``); when
    ``n < size`` the last segments are empty, which the schedule handles like any other.
    """
    if size < 1:
        raise ValueError(f"ring size must be >= 1, got {size}")
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    base, extra = divmod(n, size)
    bounds, start = [], 0
    for i in range(size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunks(start: int, stop: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into pieces of at most ``chunk_elems`` elements (none if empty)."""
    if chunk_elems < 1:
        raise ValueError(f"chunk size must be >= 1 element, got {chunk_elems}")
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]


def allreduce_phases(rank: int, size: int) -> list[Phase]:
    """The 2(N-1) phases of reduce-scatter + allgather for ``rank`` in a ring of ``size``.

    Invariant (tested): ``phases[p + 1].send == phases[p].recv`` for every p, so what was just
    received (and reduced) is exactly what is sent next.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside ring of size {size}")
    rs = [Phase((rank - s) % size, (rank - s - 1) % size, True) for s in range(size - 1)]
    ag = [Phase((rank + 1 - s) % size, (rank - s) % size, False) for s in range(size - 1)]
    return rs + ag


def left(rank: int, size: int) -> int:
    """The neighbour a rank receives from."""
    return (rank - 1) % size


def right(rank: int, size: int) -> int:
    """The neighbour a rank sends to."""
    return (rank + 1) % size


def neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)``: the ranks this one receives from and sends to, the only two a
    transport ever connects to."""
    return left(rank, size), right(rank, size)
