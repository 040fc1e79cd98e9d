"""The step timeline (``--trace-steps A-B``): Chrome trace-event JSON of a window of steps.

Pipeline position: one :class:`Tracer` per worker, handed to the parts it times (the IPU, the
reducer and its hook, the ring engine, the step loop). Each records ``X`` slices into one
preallocated int64 table: start and end (``perf_counter_ns``), lane, name, index, step, value.
Outside the window :attr:`Tracer.on` is False and every call returns at its first line, so the
step pays a few attribute reads (measured: no difference in ``bench step``, docs/trainer.md).

After the window every worker hands its trace to the chief over the collective itself
(:func:`gather`: the bytes ride in an allreduce, so no extra port, volume or RPC is needed and
it works on the ring and under MPI alike); the chief writes ``trace-rank<R>.json`` per rank and
``trace.json`` (:func:`merge`), one process per rank. Time stamps are wall-clock (Unix epoch)
microseconds, each rank's ``perf_counter`` shifted by its own ``time_ns`` offset: exact on one
host, as good as the nodes' clock sync (NTP: well under a millisecond) on a cluster.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain import files, optionrules

#: Lanes (Chrome ``tid``, also the display order). A tile ``j`` of the emulated IPU gets
#: ``FORWARD + 2j`` and ``BACKWARD + 2j``.
STEP, DATA, WEIGHTS, FORWARD, BACKWARD = 1, 2, 3, 10, 11
#: pipeline stage ``s`` (on IPU ``s``) gets lane ``STAGE + s`` (``pipeline_ipu``)
STAGE, MAX_STAGES = 40, 20
GRADS, ALLREDUCE, OPTIMIZER, CHECKPOINT = 60, 61, 62, 63
LANES = {
    STEP: "step",
    DATA: "data loading",
    WEIGHTS: "weights in",
    GRADS: "gradients out",
    ALLREDUCE: "allreduce",
    OPTIMIZER: "optimizer",
    CHECKPOINT: "checkpoint",
}
#: what the value column means, per slice name (the slice's ``args``)
VALUE_ARGS = {
    "allreduce bucket": "bytes",
    "grad piece": "bytes",
    "weights in": "bytes",
    "data to IPU": "bytes",
    "apply": "elements",
    "reduce-scatter": "phase",
    "allgather": "phase",
}
#: rows reserved per step of the window; the cnn with 2 workers records about 80
EVENTS_PER_STEP = 512
#: the longest window, so the table stays a few MB (a longer one is refused)
MAX_WINDOW_STEPS = optionrules.MAX_TRACE_STEPS
_COLS = 7  # t0, t1, lane, name, index, step, value


#: ``"A-B"`` (or ``"A"``) → (A, B): the rule is the contract's, so ``ringtrain render`` refuses
#: what the worker refuses (issue 35)
parse_steps = optionrules.trace_window


def lane_name(lane: int) -> str:
    if lane in LANES:
        return LANES[lane]
    if STAGE <= lane < STAGE + MAX_STAGES:
        return f"pipeline stage {lane - STAGE + 1} (IPU {lane - STAGE})"
    tile, kind = divmod(lane - FORWARD, 2)
    return ("backward" if kind else "forward") + (f" (tile {tile})" if tile else "")


class _Span:
    __slots__ = ("index", "lane", "name", "t0", "tracer", "value")

    def __init__(self, tracer: Tracer, lane: int, name: str, index: int, value: int):
        self.tracer, self.lane, self.name, self.index, self.value = tracer, lane, name, index, value

    def __enter__(self) -> _Span:
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        self.tracer.add(self.lane, self.name, self.t0, self.index, self.value)


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NO_SPAN = _NoSpan()


class Tracer:
    """Records slices while :attr:`on` (a step inside the window); a no-op otherwise.

    Safe from several threads: each slice claims its row with one ``next()`` of a counter
    (atomic under the GIL) and writes only that row."""

    def __init__(
        self,
        window: tuple[int, int] | None = None,
        rank: int = 0,
        events_per_step: int = EVENTS_PER_STEP,
    ):
        self.window, self.rank = window, rank
        self.first, self.last = window if window else (1, 0)
        self.on = False
        self.step = 0
        self.recorded = self.collected = False
        self._rows = np.zeros(
            (max(0, self.last - self.first + 1) * events_per_step, _COLS), np.int64
        )
        self._count = itertools.count()
        self._names: dict[str, int] = {}
        self._step_args: dict[int, dict] = {}
        self._epoch_ns = time.time_ns() - time.perf_counter_ns()

    # -- recording (the hot path: first line returns when off) --------------------------------

    def begin_step(self, step: int) -> None:
        """Step ``step`` (counted from 1) starts; it is recorded when inside the window."""
        self.step = step
        self.on = self.first <= step <= self.last
        self.recorded = self.recorded or self.on

    def now(self) -> int:
        return time.perf_counter_ns() if self.on else 0

    def add(
        self, lane: int, name: str, t0: int, index: int = -1, value: int = -1, t1: int = 0
    ) -> None:
        """A slice from ``t0`` (:meth:`now`) to ``t1`` (default: now)."""
        if not self.on:
            return
        t1 = t1 or time.perf_counter_ns()
        row = next(self._count)
        if row < len(self._rows):
            name_id = self._names.setdefault(name, len(self._names))
            self._rows[row] = (t0, t1, lane, name_id, index, self.step, value)

    def span(self, lane: int, name: str, index: int = -1, value: int = -1):
        """``with tracer.span(lane, name):`` records the block as one slice."""
        return _Span(self, lane, name, index, value) if self.on else _NO_SPAN

    def laps(self, lane: int, names: Sequence[str]) -> Callable[[int], None] | None:
        """Consecutive slices: each call ``lap(i)`` ends ``names[i]``, started at the previous
        call (or now). None when off, so callers test it once per loop."""
        if not self.on:
            return None
        last = [time.perf_counter_ns()]

        def lap(i: int) -> None:
            t = time.perf_counter_ns()
            self.add(lane, names[i], last[0], t1=t)
            last[0] = t

        return lap

    def end_step(self, t0: int, **args: float) -> None:
        """The step's own slice, with ``args`` (the reducer's statistics of the step)."""
        if self.on:
            self._step_args[self.step] = args
            self.add(STEP, "step", t0, self.step)

    # -- output --------------------------------------------------------------------------------

    def due(self, step: int, finished: bool = False) -> bool:
        """Is the trace to be collected now, ``step`` steps done? Once: past the window's last
        step, or when training ends inside it. Every rank computes the same answer."""
        return self.recorded and not self.collected and (step >= self.last or finished)

    def chrome(self) -> dict[str, Any]:
        """This rank's trace as a Chrome trace-event document."""
        claimed = next(self._count)
        self._count = itertools.count(claimed)  # reading the counter advanced it
        rows = self._rows[: min(claimed, len(self._rows))]
        names = {v: k for k, v in self._names.items()}
        pid = self.rank
        out: list[dict[str, Any]] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": "rank"},
            },  # Perfetto shows "rank 0"
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            },
        ]
        for lane in sorted({int(r[2]) for r in rows}):
            out += [
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": lane,
                    "args": {"name": lane_name(lane)},
                },
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": lane,
                    "args": {"sort_index": lane},
                },
            ]
        for t0, t1, lane, name_id, index, step, value in rows.tolist():
            name = names[name_id]
            ts, end = (t0 + self._epoch_ns) // 1000, (t1 + self._epoch_ns) // 1000
            args: dict[str, Any] = {"step": step}
            if value >= 0:
                args[VALUE_ARGS.get(name, "value")] = value
            if lane == STEP and name == "step":
                args.update(self._step_args.get(step, {}))
            out.append(
                {
                    "ph": "X",
                    "name": f"{name} {index}" if index >= 0 else name,
                    "cat": lane_name(lane),
                    "ts": ts,
                    "dur": end - ts,
                    "pid": pid,
                    "tid": lane,
                    "args": args,
                }
            )
        dropped = max(0, claimed - len(self._rows))
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {
                "ringtrain": {
                    "rank": pid,
                    "steps": [self.first, self.last],
                    "clock": "unix epoch microseconds",
                    "dropped": dropped,
                }
            },
        }


#: the tracer of a worker without ``--trace-steps``: never on, no table
OFF = Tracer()


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One trace of several ranks' traces: their events side by side (each rank is its own
    ``pid`` already, on the common wall clock)."""
    events: list[dict[str, Any]] = []
    meta = []
    for d in docs:
        events += d.get("traceEvents", [])
        meta.append((d.get("otherData") or {}).get("ringtrain", {}))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"ringtrain": {"ranks": meta, "clock": "unix epoch microseconds"}},
    }


def gather(collective, payload: bytes, tag: int = -3) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank (called by all at one point).

    Two bytes ride in each float32 of an allreduce (sum of one nonzero and zeros is exact, and
    the mean's rounding, relative 2**-24, is far below the 0.5 that ``round`` forgives). The
    bandwidth is N times the payload's: fine for a trace handed over once per job."""
    n, rank = collective.size, collective.rank
    if n == 1:
        return [payload]
    sizes = np.zeros(2 * n, np.float32)
    sizes[2 * rank : 2 * rank + 2] = divmod(len(payload), 1 << 16)
    collective.allreduce_mean_(sizes, step=-1, tag=tag)
    lengths = [
        int(hi) * (1 << 16) + int(lo)
        for hi, lo in np.rint(sizes.astype(np.float64) * n).reshape(n, 2)
    ]
    width = (max(lengths) + 1) // 2
    buf = np.zeros((n, width), np.float32)
    own = np.frombuffer(payload + b"\0" * (2 * width - len(payload)), np.uint16)
    buf[rank] = own
    collective.allreduce_mean_(buf.reshape(-1), step=-1, tag=tag - 1)
    words = np.rint(buf.astype(np.float64) * n).astype(np.uint16)
    return [words[r].tobytes()[: lengths[r]] for r in range(n)]


def collect(tracer: Tracer, collective, directory: str | Path) -> str | None:
    """Hand every rank's trace to the chief, which writes ``trace-rank<R>.json`` and the merged
    ``trace.json`` into ``directory``; returns that path on the chief, None elsewhere."""
    tracer.collected, tracer.on = True, False
    own = json.dumps(tracer.chrome(), separators=(",", ":")).encode()
    parts = gather(collective, own)
    if collective.rank != 0:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    docs = []
    for r, raw in enumerate(parts):
        (out / f"trace-rank{r}.json").write_bytes(raw)
        docs.append(json.loads(raw))
    path = files.atomic_write(
        out / "trace.json", json.dumps(merge(docs), separators=(",", ":")).encode()
    )
    return str(path)
