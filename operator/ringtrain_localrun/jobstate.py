"""The job's state as the runner sees it, folded from the replicas' output (pure).

Pipeline position: the supervisor hands every event a replica prints (:mod:`ringtrain.events`)
and every ``/status`` answer to :class:`JobState`; the console shows :meth:`JobState.progress`,
and :func:`summary` is the last object `ringtrain run` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ringtrain import events
from ringtrain_operator import spec as jobspec

from .plan import CHECKPOINT_VOLUME


@dataclasses.dataclass
class WorkerState:
    step: int | None = None
    last_output_s: float | None = None
    exit_code: int | None = None

    def health(self, now_s: float, stale_after_s: float) -> str:
        if self.exit_code is not None:
            return "done" if self.exit_code == 0 else f"exit {self.exit_code}"
        if self.last_output_s is not None and now_s - self.last_output_s > stale_after_s:
            return f"silent {now_s - self.last_output_s:.0f}s"
        return "ok"


@dataclasses.dataclass
class JobState:
    """Progress of the job as the chief reports it, plus each replica's health."""

    total_steps: int | None
    started_s: float
    workers: dict[str, WorkerState]
    step: int | None = None
    epoch: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    test_accuracy: float | None = None
    #: the step the last evaluation ran at: the progress line says how old its accuracy is
    test_accuracy_step: int | None = None
    final: events.Final | None = None
    #: the evaluator's evaluations, in order (TF_CONFIG task type evaluator)
    evaluations: list[events.Evaluation] = dataclasses.field(default_factory=list)

    def observe(self, label: str, event: events.Event | None, now_s: float, chief: bool) -> None:
        """A replica printed ``event`` (None: any other line): it is alive; the chief's events
        are the job's progress."""
        w = self.workers[label]
        w.last_output_s = now_s
        if isinstance(event, (events.Progress, events.Eval)) and isinstance(event.step, int):
            w.step = event.step
        if isinstance(event, events.Evaluation):
            self.evaluations.append(event)
            w.step = event.step
        if not chief:
            return
        if isinstance(event, events.Progress):
            for f in ("step", "epoch", "loss", "samples_per_s", "eta_s", "total_steps"):
                if getattr(event, f) is not None:
                    setattr(self, f, getattr(event, f))
        elif isinstance(event, events.Eval) and event.test_accuracy is not None:
            self.test_accuracy = event.test_accuracy
            self.test_accuracy_step = event.step if isinstance(event.step, int) else None
        elif isinstance(event, events.Final):
            self.final = event
            if event.test_accuracy is not None:
                self.test_accuracy = event.test_accuracy
            if event.steps is not None:
                self.step = event.steps

    def observe_status(self, label: str, st: events.Status, now_s: float) -> None:
        """A replica answered ``/status``: alive, at that step (workers that print nothing)."""
        w = self.workers[label]
        w.last_output_s = now_s
        if isinstance(st.step, int):
            w.step = st.step

    def new_gang(self, labels: Iterable[str], now_s: float) -> None:
        """Restarted replicas (the chief: from a checkpoint): forget their old step and health,
        and the job's progress, which the restarted chief reports anew."""
        for label in labels:
            self.workers[label] = WorkerState(last_output_s=now_s)
        self.step = self.epoch = self.loss = self.samples_per_s = self.eta_s = None
        self.final = None

    def progress(self, now_s: float, stale_after_s: float = 60.0) -> dict:
        return {
            "event": "progress",
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.epoch,
            "loss": self.loss,
            "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s,
            "test_accuracy": self.test_accuracy,
            "test_accuracy_step": self.test_accuracy_step,
            "elapsed_s": round(now_s - self.started_s, 3),
            "workers": {k: w.health(now_s, stale_after_s) for k, w in self.workers.items()},
        }


def terminal_condition(job_status: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(reason, message) of the condition that ended the job, as ``kubectl describe`` shows it."""
    state = job_status.get("state")
    for c in job_status.get("conditions") or []:
        if c["type"] == state and c["status"] == "True":
            return c.get("reason"), c.get("message")
    return None, None


def summary(
    job: jobspec.Job,
    phase: str,
    state: JobState,
    exits: Mapping[str, int | None],
    run_dir: Path,
    elapsed_s: float,
    reason: str | None,
    message: str | None = None,
    restarts: int = 0,
    chief_result: events.Final | None = None,
) -> dict:
    """The final object: the job's phase (with the condition's reason and message, as the
    operator writes them), its restarts, and the chief's final metrics — from its last
    line, else ``chief_result`` (its termination log), else the last progress seen — with the
    model it exported and the evaluator's evaluations."""
    final = state.final or chief_result
    checkpoint = final.checkpoint if final else None
    if checkpoint is None and job.trainer:
        checkpoint = str(run_dir / CHECKPOINT_VOLUME)
    return {
        "event": "final",
        "job": job.name,
        "phase": phase,
        "reason": reason,
        "message": message,
        "restarts": restarts,
        "steps": final.steps if final else state.step,
        "loss": final.loss if final else state.loss,
        "test_accuracy": final.test_accuracy if final else state.test_accuracy,
        "samples_per_s": final.samples_per_s if final else state.samples_per_s,
        "skipped_steps": final.skipped_steps if final else None,
        "elapsed_s": round(elapsed_s, 3),
        "checkpoint": checkpoint,
        "export": final.export if final else None,
        "evaluations": [e.to_dict() for e in state.evaluations],
        "trace": final.trace if final else None,
        "run_dir": str(run_dir),
        "exit_codes": dict(exits),
    }
