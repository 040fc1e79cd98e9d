"""Gradient reducer: fuse per-layer gradients into buckets, allreduce them while backward runs.

Pipeline position: between the emulated IPU (which calls :meth:`Reducer.on_grad` as each
layer's gradient streams out, last layer first) and the optimizer. Like PyTorch DDP, bucket
assignment is a pure function of parameter sizes in arrival order and a byte cap, with a small
first bucket so communication starts early. Because parameters are laid out in reverse layer
order, every bucket is a contiguous slice of the flat gradient buffer: the collective reduces
it in place, without packing.

A single communication thread issues every collective, in the same order on every rank (the
contract of ``trainer.collective``), and applies the optimizer to each bucket as soon as its
mean is known. With one worker there is nothing to reduce: the optimizer is applied to each
layer inline, as Horovod registers no hooks for size 1.
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ringtrain_trainer.collective import Collective
from ringtrain_trainer.optim import Optimizer

#: DDP's default cap: 25 MiB buckets.
DEFAULT_BUCKET_BYTES = 25 * (1 << 20)
#: the first bucket's cap. DDP uses 1 MiB, sized for models of hundreds of MB; the cnn's
#: gradients are 1.39 MB in all, so 1 MiB would hold back three quarters of them (measured:
#: 256 KiB hides more of the allreduce, see docs/trainer.md)
FIRST_BUCKET_BYTES = 256 << 10
#: parameters larger than this (elements) are split into about equal pieces, so that a
#: bucket can start while the IPU still streams the rest of a large kernel (model.py streams
#: such kernels in row blocks of the same size)
PIECE_ELEMS = 1 << 16
#: the communication thread applies the optimizer in slices of this many elements and looks
#: for a newly completed bucket between them: an allreduce waits for peers, the optimizer not
APPLY_ELEMS = 1 << 16
#: GIL switch interval while a communication thread runs (CPython's default is 5 ms)
COMM_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int
    stop: int
    params: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def assign_buckets(sizes: Sequence[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   first_bucket_bytes: int = FIRST_BUCKET_BYTES, itemsize: int = 4) -> list[Bucket]:
    """Group consecutive parameters (sizes in elements, in arrival order) into buckets.

    DDP's rule: add parameters to the open bucket until its bytes reach the cap, then close it;
    the first bucket's cap is ``min(first_bucket_bytes, bucket_bytes)``. Unlike DDP, a
    parameter of more than ``PIECE_ELEMS`` elements is first cut into about equal pieces that
    count as parameters of their own (the flat buffer is contiguous, so a bucket may end
    mid-parameter, and the optimizer works element by element), and the last piece of a cut
    parameter closes its bucket: the next layer's gradients come later, after backward has
    moved on, and would otherwise hold the finished pieces back.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    units: list[tuple[int, int, bool]] = []  # (parameter, elements, last piece of a cut one)
    for i, n in enumerate(sizes):
        pieces = max(1, -(-n // PIECE_ELEMS))
        step = max(1, -(-n // pieces))
        units += [(i, min(step, n - lo), pieces > 1 and lo + step >= n)
                  for lo in range(0, n, step)] or [(i, 0, False)]
    buckets: list[Bucket] = []
    start = offset = 0
    members: list[int] = []
    for i, n, closes in units:
        if not members or members[-1] != i:
            members.append(i)
        offset += n
        cap = min(first_bucket_bytes, bucket_bytes) if not buckets else bucket_bytes
        if (offset - start) * itemsize >= cap or closes:
            buckets.append(Bucket(len(buckets), start, offset, tuple(members)))
            start, members = offset, []
    if members:
        buckets.append(Bucket(len(buckets), start, offset, tuple(members)))
    return buckets


@dataclass(frozen=True)
class StepCommStats:
    """Communication of one step: allreduce time, the part hidden behind backward, the wait."""

    allreduce_s: float = 0.0
    hidden_s: float = 0.0
    exposed_wait_s: float = 0.0
    bytes: int = 0

    @property
    def overlap_fraction(self) -> float:
        return self.hidden_s / self.allreduce_s if self.allreduce_s > 0 else 0.0


class Reducer:
    """Turns streamed layer gradients into reduced, applied updates for one step at a time.

    Use: ``begin_step(step)``; the IPU calls ``on_grad(start, stop)``; ``finish()`` waits until
    every bucket is reduced and applied and returns that step's :class:`StepCommStats`.
    """

    def __init__(self, sizes: Sequence[int], grads: np.ndarray, collective: Collective,
                 optimizer: Optimizer, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES, control_elems: int = 0):
        self.grads, self.collective, self.optimizer = grads, collective, optimizer
        #: trailing elements reduced with the last bucket but not parameters (the optimizer
        #: never sees them); the worker uses one to agree on stopping
        self.num_params = grads.size - control_elems
        self.buckets = assign_buckets(sizes, bucket_bytes, first_bucket_bytes,
                                      grads.dtype.itemsize)
        if self.buckets and self.buckets[-1].stop != grads.size:
            raise ValueError(f"parameter sizes sum to {self.buckets[-1].stop}, "
                             f"gradient buffer has {grads.size}")
        self.local = collective.size == 1
        self._remaining = [b.size for b in self.buckets]
        self._next = 0
        self._step = 0
        self._intervals: list[tuple[float, float]] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not self.local:
            _comm_thread_started()
            self._thread = threading.Thread(target=self._comm_loop, name="ringtrain-comm",
                                            daemon=True)
            self._thread.start()

    def begin_step(self, step: int) -> None:
        self._step = step
        self._next = 0
        for i, b in enumerate(self.buckets):
            self._remaining[i] = b.size
        self._intervals.clear()

    def on_grad(self, start: int, stop: int) -> None:
        """Called by the IPU (compute thread) when gradients [start, stop) are final."""
        if self.local:
            if start < self.num_params:
                self.optimizer.apply(self.grads, start, min(stop, self.num_params))
            return
        for i in range(self._next, len(self.buckets)):
            b = self.buckets[i]
            lo, hi = max(start, b.start), min(stop, b.stop)
            if lo < hi:
                self._remaining[i] -= hi - lo
        # Buckets are launched strictly in order, the same order on every rank.
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._work.put((self.buckets[self._next], self._step))
            self._next += 1
        # Offer the CPU to the communication thread: with every core busy computing (2 cores,
        # 2 workers) a woken thread otherwise waits for the scheduler's next preemption, and
        # the allreduce started, or moved on, only after backward ended. Measured on the cnn:
        # hidden share 0.54-0.62 -> 0.76-0.79, exposed wait 2.5-4 -> 1.2-1.4 ms per step.
        _yield_cpu()

    def finish(self) -> StepCommStats:
        """Wait for every bucket of this step; raises what the communication thread raised."""
        if self.local:
            return StepCommStats()
        compute_end = time.perf_counter()
        if self._next != len(self.buckets):
            raise RuntimeError(
                f"step {self._step}: finish() before every gradient arrived "
                f"({self._next} of {len(self.buckets)} buckets launched)"
            )
        error = None
        for _ in self.buckets:
            item = self._done.get()
            if isinstance(item, BaseException) and error is None:
                error = item
        if error is not None:
            raise error
        wait = time.perf_counter() - compute_end
        total = sum(b - a for a, b in self._intervals)
        hidden = sum(max(0.0, min(b, compute_end) - a) for a, b in self._intervals)
        return StepCommStats(total, hidden, wait, self.grads.nbytes)

    def _comm_loop(self) -> None:
        """Allreduce each bucket as it comes, then apply the optimizer to it in slices; a
        bucket that completes meanwhile is reduced before the next slice is applied, so the
        last bucket of a step never queues behind the optimizer of the one before."""
        failed: BaseException | None = None
        reduced: collections.deque = collections.deque()  # [bucket, next element to apply]
        while True:
            if reduced:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    head = reduced[0]
                    bucket, at = head
                    stop = min(at + APPLY_ELEMS, bucket.stop, self.num_params)
                    if at < stop:
                        self.optimizer.apply(self.grads, at, stop)
                    head[1] = stop
                    if stop >= min(bucket.stop, self.num_params):
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
                view = self.grads[bucket.start:bucket.stop]
                t0 = time.perf_counter()
                self.collective.allreduce_mean_(view, step=step, tag=bucket.index)
                self._intervals.append((t0, time.perf_counter()))
                reduced.append([bucket, bucket.start])
            except BaseException as e:  # handed to the step loop, which maps it to an exit code
                failed = e
                self._done.put(e)

    def close(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                self._work.put(None)
                self._thread.join()
            self._thread = None
            _comm_thread_stopped()


_yield_cpu = getattr(os, "sched_yield", lambda: None)  # POSIX only

# CPython hands the GIL to a waiting thread only when the holder blocks or after the switch
# interval (5 ms). The compute thread does release it inside every numpy call, but a woken
# communication thread that has to wait for a CPU usually finds it taken again and then waits
# the whole interval: measured, a bucket's allreduce often started only when backward ended.
# While any communication thread runs, the interval is lowered (and restored after the last).
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


def _comm_thread_started() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, COMM_SWITCH_INTERVAL_S))
        _switch_users += 1


def _comm_thread_stopped() -> None:
    global _switch_users
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0:
            sys.setswitchinterval(_switch_saved)
