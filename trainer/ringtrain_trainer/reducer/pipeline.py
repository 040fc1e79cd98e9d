"""The reducer: streamed gradient pieces in, reduced and applied updates out, step by step.

Pipeline position: between the emulated IPU, which calls :meth:`Reducer.on_grad` as each
gradient piece streams out (last layer first), and the optimizer. Three parts, as PyTorch
DDP's comm hook plus ``_hook_then_optimizer``: :class:`~.buckets.Readiness` says which buckets
are complete, the :class:`~.comm.CommThread` runs the collective per ready bucket in order,
and the on-reduced :class:`~.hook.OptimizerHook` applies the optimizer to each reduced slice.
The reducer owns the flat buffer the IPU writes gradients into, with the :class:`~.stopvote.
StopVote` element after them. With one worker there is nothing to reduce: the pieces are
collected and the hook runs once per contiguous run at :meth:`Reducer.finish` (Horovod
registers no hooks for size 1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from ringtrain_trainer import trace
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.optim import Optimizer
from ringtrain_trainer.reducer.buckets import (
    DEFAULT_BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Readiness,
    assign_buckets,
)
from ringtrain_trainer.reducer.comm import CommThread, yield_cpu
from ringtrain_trainer.reducer.hook import OptimizerHook
from ringtrain_trainer.reducer.stopvote import StopVote


@dataclass(frozen=True)
class StepCommStats:
    """Communication of one step, as seen from this worker (times in seconds).

    ``allreduce_s``: the collectives' wall time. ``hidden_s``: the part of it that ran while
    backward was still computing here *and* was not spent blocked on a peer: waiting for a
    slower peer hides nothing, it only moves the wait. ``peer_wait_s``: the collectives' time
    blocked on peers, wherever it fell. ``exposed_wait_s``: how long the compute thread waited
    after backward for the last bucket to be reduced and applied. ``lead_s``: how long before
    the end of backward the step's first allreduce started (0: not before, as with
    ``overlap=False``). What the communication thread's CPU takes from backward shows in no
    figure here; ``ringtrain bench step --workers N`` measures it against a no-communication
    run of the same workers.
    """

    allreduce_s: float = 0.0
    hidden_s: float = 0.0
    exposed_wait_s: float = 0.0
    bytes: int = 0
    peer_wait_s: float = 0.0
    lead_s: float = 0.0

    @property
    def overlap_fraction(self) -> float:
        """The share of the allreduce time hidden behind backward (the live metric)."""
        return self.hidden_s / self.allreduce_s if self.allreduce_s > 0 else 0.0

    def __add__(self, other: StepCommStats) -> StepCommStats:
        """Field by field. Not ``astuple``: it deep-copies every field, 13 µs per sum, which
        ``bench step`` paid once per timed step, 4-7 % of a small zoo model's (issue 39)."""
        return StepCommStats(*(getattr(self, n) + getattr(other, n) for n in _STAT_FIELDS))


_STAT_FIELDS = tuple(f.name for f in fields(StepCommStats))


def hidden_seconds(
    intervals: Sequence[tuple[float, float]],
    waits: Sequence[tuple[float, float]],
    compute_end: float,
) -> float:
    """Collective time before ``compute_end`` that was not spent blocked on a peer.

    ``intervals`` are the collectives' (start, end), ``waits`` the blocked spans inside them;
    both clipped at the end of backward."""
    busy = sum(max(0.0, min(b, compute_end) - a) for a, b in intervals)
    blocked = sum(max(0.0, min(b, compute_end) - a) for a, b in waits)
    return max(0.0, busy - blocked)


class Reducer:
    """Turns streamed gradient pieces into reduced, applied updates for one step at a time.

    ``pieces``: per parameter in arrival order, the sizes of the pieces it streams in (see
    :func:`~.buckets.assign_buckets`); they must cover the optimizer's parameters. Use:
    ``begin_step(step, epoch)``; the IPU writes :attr:`grads` and calls ``on_grad(start,
    stop)`` per piece; ``finish()`` waits until every bucket is reduced and applied and
    returns that step's :class:`StepCommStats`.

    ``overlap=False`` (the worker's ``--no-overlap-comm``) holds every bucket until backward
    ends and only then reduces them, in the same order: the serialized baseline that shows
    what overlapping buys (``ringtrain bench step --workers N`` runs both).
    """

    def __init__(
        self,
        pieces: Sequence[int | Sequence[int]],
        collective: Collective,
        optimizer: Optimizer,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        stop_vote: bool = False,
        overlap: bool = True,
        tracer: trace.Tracer = trace.OFF,
    ):
        self.collective, self.tracer = collective, tracer
        self.overlap = overlap
        n = optimizer.params.size
        #: the gradients, then the stop vote's element: reduced together
        self.buffer = np.zeros(n + (StopVote.ELEMS if stop_vote else 0), optimizer.params.dtype)
        #: what the IPU writes: the parameters' gradients, a view of :attr:`buffer`
        self.grads = self.buffer[:n]
        self.vote = StopVote(self.buffer, n) if stop_vote else None
        self.hook = OptimizerHook(optimizer, self.buffer, tracer)
        self.buckets = assign_buckets(
            list(pieces) + ([[StopVote.ELEMS]] if stop_vote else []),
            bucket_bytes,
            first_bucket_bytes,
            self.buffer.itemsize,
        )
        if self.buckets and self.buckets[-1].stop != self.buffer.size:
            raise ValueError(
                f"piece sizes sum to {self.buckets[-1].stop}, "
                f"gradient buffer has {self.buffer.size}"
            )
        self.local = collective.size == 1
        #: one worker: this step's pieces, applied by finish() (see OptimizerHook.apply_run)
        self._pieces: list[tuple[int, int]] = []
        self.ready = Readiness(self.buckets)
        self._step = 0
        self._comm: CommThread | None = None  # started by the first step, not at construction
        #: reduce float16 copies of the buckets (half the ring's bytes); set before the first
        #: step (``--allreduce-dtype``)
        self.wire_half = False
        #: the collective's blocked spans this step (see ``Collective.peer_waits``)
        self._waits: list[tuple[float, float]] = []

    def begin_step(self, step: int, epoch: int = 0, stop: bool = False) -> None:
        """Start the optimizer's step for ``epoch`` and this worker's stop vote."""
        self._step = step
        self.hook.begin_step(epoch)
        if self.local:
            self._pieces.clear()
            return
        if self._comm is None:
            self._comm = CommThread(
                self.buffer, self.collective, self.hook, self.tracer, half=self.wire_half
            )
        self.ready.reset()
        self._comm.intervals.clear()
        self._waits.clear()
        self.collective.peer_waits = self._waits  # per step: reducers may share a collective
        if self.vote is not None:
            self.vote.cast(stop)
            self.on_grad(*self.vote.piece)

    def on_grad(self, start: int, stop: int) -> None:
        """Called by the IPU (compute thread) when gradients [start, stop) are final."""
        if self.local:
            self._pieces.append((start, stop))
            return
        ready = self.ready.add(start, stop)
        if not self.overlap:
            return
        assert self._comm is not None  # begin_step started it
        for i in ready:
            self._comm.submit(self.buckets[i], self._step)
        # Offer the CPU to the communication thread: with every core busy computing (2 cores,
        # 2 workers) a woken thread otherwise waits for the scheduler's next preemption, and
        # the allreduce started, or moved on, only after backward ended. Measured on the cnn:
        # hidden share 0.54-0.62 -> 0.76-0.79, exposed wait 2.5-4 -> 1.2-1.4 ms per step.
        yield_cpu()

    def finish(self) -> StepCommStats:
        """Wait for every bucket of this step; raises what the communication thread raised."""
        if self.local:
            self._apply_local()
            return StepCommStats()
        t_ns = time.perf_counter_ns()  # the same reading for the statistics and the trace
        compute_end = t_ns * 1e-9
        if self.ready.launched != len(self.buckets):
            raise RuntimeError(
                f"step {self._step}: finish() before every gradient arrived "
                f"({self.ready.launched} of {len(self.buckets)} buckets launched)"
            )
        assert self._comm is not None  # begin_step started it
        if not self.overlap:
            for b in self.buckets:
                self._comm.submit(b, self._step)
        self._comm.wait(len(self.buckets))
        wait = time.perf_counter() - compute_end
        self.tracer.add(trace.STEP, "wait for allreduce", t_ns)
        iv = self._comm.intervals
        total = sum(b - a for a, b in iv)
        lead = max(0.0, compute_end - iv[0][0]) if iv else 0.0
        return StepCommStats(
            total,
            hidden_seconds(iv, self._waits, compute_end),
            wait,
            self.buffer.nbytes // 2 if self.wire_half else self.buffer.nbytes,
            sum(b - a for a, b in self._waits),
            lead,
        )

    def _apply_local(self) -> None:
        """This step's pieces, a contiguous run (backward streams last layer first) at a time."""
        run: list[tuple[int, int]] = []
        for a, b in self._pieces:
            if run and b != run[-1][0] and a != run[-1][1]:
                self.hook.apply_run(run)
                run = []
            run.append((a, b))
        if run:
            self.hook.apply_run(run)
        self._pieces.clear()

    def close(self) -> None:
        if self._comm is not None:
            self._comm.close()
            self._comm = None
