"""The communication thread: one collective per ready bucket, then the on-reduced callback.

A single thread issues every collective, in the order buckets are submitted (the same order on
every rank, the contract of ``collective``), and hands each reduced bucket to ``on_reduced``
in slices of ``APPLY_ELEMS``. Between slices it looks for a newly submitted bucket and reduces
that first: an allreduce waits for peers, the callback (the optimizer) not, so the last bucket
of a step never queues behind the optimizer of the one before. While the thread runs the GIL
switch interval is lowered (:mod:`.switch`).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from ringtrain_trainer import trace
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.reducer.buckets import Bucket
from ringtrain_trainer.reducer.switch import lowered_switch_interval

#: the on-reduced callback runs in slices of this many elements, with a look for a newly
#: completed bucket between them
APPLY_ELEMS = 1 << 16

#: offer the CPU to the communication thread (POSIX only)
yield_cpu = getattr(os, "sched_yield", lambda: None)


class CommThread:
    """Reduces submitted buckets of ``buffer`` in place, in order; :meth:`wait` collects them."""

    def __init__(
        self,
        buffer: np.ndarray,
        collective: Collective,
        on_reduced: Callable[[int, int], None],
        tracer: trace.Tracer = trace.OFF,
        half: bool = False,
    ):
        self.buffer, self.collective, self.on_reduced = buffer, collective, on_reduced
        #: float16 on the wire: each bucket is cast into this buffer, reduced there (half the
        #: bytes; the sum and mean in float16, so an overflow is an inf the loss scale sees)
        #: and cast back; allocated once
        self.half = np.zeros(buffer.size, np.float16) if half else None
        self.tracer = tracer
        #: (start, end) perf_counter seconds of each allreduce this step
        self.intervals: list[tuple[float, float]] = []
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        running = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(running,), name="ringtrain-comm", daemon=True
        )
        self._thread.start()
        running.wait()

    def submit(self, bucket: Bucket, step: int) -> None:
        self._work.put((bucket, step))

    def wait(self, count: int) -> None:
        """Wait until ``count`` submitted buckets are reduced and handed on; raises what the
        thread raised (after all of them reported, so none is left behind)."""
        error = None
        for _ in range(count):
            item = self._done.get()
            if isinstance(item, BaseException) and error is None:
                error = item
        if error is not None:
            raise error

    def _run(self, running: threading.Event) -> None:
        with lowered_switch_interval():
            running.set()
            self._loop()

    def _loop(self) -> None:
        failed: BaseException | None = None
        reduced: collections.deque = collections.deque()  # [bucket, next element to hand on]
        while True:
            if reduced:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    head = reduced[0]
                    bucket, at = head
                    stop = min(at + APPLY_ELEMS, bucket.stop)
                    self.on_reduced(at, stop)
                    head[1] = stop
                    if stop >= bucket.stop:
                        reduced.popleft()
                        self._done.put(bucket.index)
                    continue
            else:
                item = self._work.get()
            if item is None:
                return
            bucket, step = item
            if failed is not None:  # a broken ring: report, never touch it again
                self._done.put(failed)
                continue
            try:
                view = self.buffer[bucket.start : bucket.stop]
                wire = view
                if self.half is not None:
                    wire = self.half[bucket.start : bucket.stop]
                    with np.errstate(over="ignore"):
                        np.copyto(wire, view, casting="same_kind")
                # one pair of readings serves the statistics and the trace alike
                t0 = time.perf_counter_ns()
                self.collective.allreduce_mean_(wire, step=step, tag=bucket.index)
                t1 = time.perf_counter_ns()
                if wire is not view:
                    np.copyto(view, wire)
                self.intervals.append((t0 * 1e-9, t1 * 1e-9))
                self.tracer.add(
                    trace.ALLREDUCE, "allreduce bucket", t0, bucket.index, wire.nbytes, t1=t1
                )
                reduced.append([bucket, bucket.start])
            except BaseException as e:  # noqa: BLE001 - handed to the step loop (exit code)
                failed = e
                self._done.put(e)

    def close(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                self._work.put(None)
                self._thread.join()
            self._thread = None
