"""The IPU's host threads: shard groups run side by side, in lock step at every gradient piece.

Pipeline position: the emulated IPU (``ipu``) cuts a batch into shards and the shards into one
group per host thread; each group computes forward, then backward piece by piece
(``ModelSpec.grad_pieces``), yielding each piece once its shards have written it. The caller
takes piece k from every group before averaging it, so no group is more than a piece ahead.

Why the first group runs on the calling thread, between its hand-offs of pieces, and only the
others on pool threads: with a pool thread per group the caller was a third thread on two CPUs,
woken at every piece, and a step of the seeds' CNN took 3.9 ms where its two shards computed for
2.3 ms each.

Why lock step and not "the last group to finish a piece averages it": measured (README,
decisions), that schedule let the caller's group run its backward while the other group was
still in forward reading the weights the caller had just streamed in from the caller's core,
and the seeds' CNN step got slower (25,800-27,400 -> 24,000-24,300 samples/s).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

_DONE = object()


def threads_for(work: int, per_ipu: int, host_threads: int, min_flops: int, coupled: bool) -> int:
    """The most host threads (at most ``host_threads``) that split an IPU's batch of
    ``per_ipu`` evenly and leave each shard at least ``min_flops`` of ``work`` (one at the
    least); one when the model has batch statistics (``coupled``), which are over the
    replica's whole batch, never a shard's."""
    if coupled:
        return 1
    return max(
        d
        for d in range(1, min(host_threads, per_ipu) + 1)
        if per_ipu % d == 0 and (d == 1 or work // d >= min_flops)
    )


class ShardGroups:
    """The host threads that run an IPU's shard groups (the first group on the caller's)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def launch(
        self, groups: list[list[int]], work: Callable[[list[int]], Iterator]
    ) -> list[Iterator]:
        """``work(group)`` for every group: the first as a generator the caller advances, the
        others started now on pool threads, each an iterator over its pieces."""
        if len(groups) == 1:
            return [work(groups[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="ipu-tile")
        return [work(groups[0]), *(self._threaded(work(g)) for g in groups[1:])]

    def _threaded(self, gen: Iterator) -> Iterator:
        assert self._pool is not None
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._pool.submit(_pump, gen, q)

        def pieces() -> Iterator:
            while (item := q.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return pieces()

    @staticmethod
    def finish(runs: list[Iterator]) -> None:
        """Run every group to its end (even after a failure) so no thread outlives the step."""
        error = None
        for run in runs:
            try:
                for _ in run:
                    pass
            except BaseException as e:  # noqa: BLE001 - the first error is re-raised below
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _pump(gen: Iterator, q: queue.SimpleQueue) -> None:
    try:
        for piece in gen:
            q.put(piece)
        q.put(_DONE)
    except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
        q.put(e)
