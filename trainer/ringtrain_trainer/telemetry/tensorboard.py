"""TensorBoard event files: the chief's training scalars and the evaluator's eval scalars.

Pipeline position: beside :mod:`.metrics`. Prometheus answers "how is the job now"; these files
answer "how did it converge", which is what a TensorFlow user opens TensorBoard for. The chief's
:class:`TrainWriter` adds up each step's figures (a few float additions) and writes their means
only when the worker prints a progress line (about once a second), so TensorBoard shows the same
points as the log; the evaluator's :class:`EvalWriter` writes one point per checkpoint it
evaluates. Files are written by tensorboardX's ``SummaryWriter`` (its own writer thread, CRC'd
records), never by hand.

Where: ``--tensorboard-dir`` (``spec.trainer.tensorboard.logDir``), else
``<checkpoint dir>/tensorboard``; one run directory per role under it (``chief``,
``evaluator``), so ``tensorboard --logdir`` on that directory shows both. With neither
directory the writers are off and every call returns at its first line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ringtrain_trainer.ipu.device import IPUStats
from ringtrain_trainer.reducer import StepCommStats

#: seconds between the writer thread's flushes (what a live TensorBoard lags behind at most)
FLUSH_S = 10
SUBDIR = "tensorboard"


def log_dir(tensorboard_dir: str | None, checkpoint_dir: str | None, role: str) -> Path | None:
    """The run directory of ``role``, or None (off) without either directory."""
    base = tensorboard_dir or (str(Path(checkpoint_dir) / SUBDIR) if checkpoint_dir else None)
    return None if base is None else Path(base) / role


def bus_bandwidth(world: int, nbytes: float, seconds: float) -> float:
    """NCCL's bus bandwidth of a ring allreduce: 2(N-1)/N x bytes / time (bytes/s), the figure
    comparable to the link's own speed whatever N is."""
    return 2 * (world - 1) / world * nbytes / seconds if world > 1 and seconds > 0 else 0.0


def summary_writer() -> type:
    """tensorboardX's ``SummaryWriter``, imported lazily (only a writing process pays for it)
    and without torch: tensorboardX imports torch when it is installed, only to accept torch
    tensors, which ringtrain never passes; with torch loaded the chief's numpy steps ran
    slower in timed runs (docs/trainer.md)."""
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return SummaryWriter


class _Writer:
    """A ``SummaryWriter`` on ``path`` once opened, or nothing at all when ``path`` is None."""

    def __init__(self, path: Path | None):
        self.path = path
        self._w: Any = None  # a tensorboardX SummaryWriter (untyped)

    def open(self, purge_step: int | None = None) -> None:
        """``purge_step``: TensorBoard drops this run's earlier points from that step on (a
        resumed chief repeats the steps after its checkpoint)."""
        if self.path is not None and self._w is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._w = summary_writer()(str(self.path), purge_step=purge_step, flush_secs=FLUSH_S)

    @property
    def on(self) -> bool:
        return self._w is not None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._w.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


class TrainWriter(_Writer):
    """The chief's scalars: loss, learning rate, samples/s, test accuracy, step time by phase,
    allreduce time, bus bandwidth and hidden fraction (each a mean over the steps since the
    last point)."""

    def __init__(self, path: Path | None, world: int):
        super().__init__(path)
        self.world = world
        self._last_compute_s = 0.0
        self._last_stage_s: tuple[float, ...] = ()
        self._reset()

    def start(self, step: int, ipu: IPUStats) -> None:
        """Before the first step (after a restore to ``step``)."""
        self.open(purge_step=step + 1 if step else None)
        self._last_compute_s = ipu.compute_s
        self._last_stage_s = ipu.stage_busy_s

    def _reset(self) -> None:
        self.steps = 0
        self.step_s = self.compute_s = 0.0
        self.allreduce_s = self.hidden_s = self.peer_wait_s = self.exposed_s = 0.0
        self.nbytes = 0
        #: per pipeline stage: its IPU's busy seconds in the interval
        self.stage_s: list[float] = []

    def observe(self, seconds: float, ipu: IPUStats, comm: StepCommStats) -> None:
        """Every step: add its figures (cheap; nothing is written)."""
        if self._w is None:
            return
        self.steps += 1
        self.step_s += seconds
        self.compute_s += ipu.compute_s - self._last_compute_s
        self._last_compute_s = ipu.compute_s
        self.allreduce_s += comm.allreduce_s
        self.hidden_s += comm.hidden_s
        self.peer_wait_s += comm.peer_wait_s
        self.exposed_s += comm.exposed_wait_s
        self.nbytes += comm.bytes
        if ipu.stage_busy_s:
            before = self._last_stage_s or (0.0,) * len(ipu.stage_busy_s)
            if len(self.stage_s) != len(ipu.stage_busy_s):
                self.stage_s = [0.0] * len(ipu.stage_busy_s)
            for s, (now, then) in enumerate(zip(ipu.stage_busy_s, before, strict=True)):
                self.stage_s[s] += now - then
            self._last_stage_s = ipu.stage_busy_s

    def progress(self, step: int, loss: float, lr: float, samples_per_s: float) -> None:
        """At a progress line: write the point of ``step`` and start the next interval."""
        if self._w is None:
            return
        n = max(1, self.steps)
        values: dict[str, Any] = {
            "train/loss": loss,
            "train/learning_rate": lr,
            "train/samples_per_s": samples_per_s,
            "step_time/total_s": self.step_s / n,
            "step_time/ipu_compute_s": self.compute_s / n,
            "step_time/exposed_allreduce_s": self.exposed_s / n,
            "step_time/other_s": max(0.0, self.step_s - self.compute_s - self.exposed_s) / n,
        }
        for s, busy in enumerate(self.stage_s):  # a pipeline: each stage's IPU, per step
            values[f"pipeline/stage{s + 1}_ipu{s}_busy_s"] = busy / n
        if self.allreduce_s > 0:
            values.update(
                {
                    "allreduce/time_s": self.allreduce_s / n,
                    "allreduce/hidden_s": self.hidden_s / n,
                    "allreduce/peer_wait_s": self.peer_wait_s / n,
                    "allreduce/overlap_fraction": self.hidden_s / self.allreduce_s,
                    "allreduce/busbw_gbps": bus_bandwidth(self.world, self.nbytes, self.allreduce_s)
                    / 1e9,
                }
            )
        self.scalars(step, values)
        self._reset()

    def test_accuracy(
        self,
        step: int,
        accuracy: float,
        ipu: IPUStats,
        metric: str = "accuracy",
        extra: dict[str, float] | None = None,
    ) -> None:
        """After an evaluation (``test/accuracy``, or ``test/mae`` after a regression loss;
        ``extra``: the compiled metrics, ``test/auc``); its forward passes are not a step's
        compute time."""
        if self._w is not None:
            more = {f"test/{k}": v for k, v in (extra or {}).items()}
            self.scalars(step, {f"test/{metric}": accuracy, **more})
            self._last_compute_s = ipu.compute_s


class EvalWriter(_Writer):
    """The evaluator's scalars, one point per evaluated checkpoint, flushed at once (they are
    minutes apart)."""

    def __init__(self, path: Path | None):
        super().__init__(path)
        self.open()

    def evaluation(
        self,
        step: int,
        loss: float,
        accuracy: float,
        metric: str = "accuracy",
        extra: dict[str, float] | None = None,
    ) -> None:
        if self._w is not None:
            more = {f"eval/test_{k}": v for k, v in (extra or {}).items()}
            self.scalars(step, {"eval/test_loss": loss, f"eval/test_{metric}": accuracy, **more})
            self._w.flush()
