"""What the client says about a job, whichever backend runs it: typed records, no I/O.

Pipeline position: the backends (:mod:`.local`, :mod:`.kube`) read a job where it runs — a
``ringtrain run`` run dir, a TrainingJob's status — and describe it as a :class:`JobStatus`;
the chief's own output, the JSON event lines every trainer prints (:mod:`ringtrain.events`),
folds into :class:`Metrics` here, so ``metrics()`` means the same on both backends. The phase
names are the operator's (``status.state``), so a job reads the same in ``kubectl get tj``,
``ringtrain status`` and ``Job.status()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ringtrain import events

SUCCEEDED, FAILED = "Succeeded", "Failed"
#: phases after which nothing changes: ``wait()`` returns or raises
TERMINAL = (SUCCEEDED, FAILED)


class JobFailed(RuntimeError):
    """``wait()`` on a job that failed: carries the job's reason and message (the condition
    ``kubectl describe tj`` shows, e.g. the worker's own error)."""

    def __init__(self, name: str, reason: str | None, message: str | None):
        super().__init__(
            f"TrainingJob {name} failed: {reason or 'unknown reason'}: {message or ''}"
        )
        self.name, self.reason, self.message = name, reason, message


class JobTimeout(TimeoutError):
    """``wait(timeout=...)`` ran out before the job ended; the job goes on."""


class JobNotFound(LookupError):
    """No job of that name where the backend looks (the run dirs, the namespace)."""


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """A job as its backend sees it now. ``phase`` is the operator's state (Created, Running,
    Restarting, Succeeded, Failed); ``reason``/``message`` its condition's."""

    name: str
    backend: str
    phase: str | None
    reason: str | None = None
    message: str | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    test_accuracy: float | None = None
    restarts: int = 0
    #: where the trained model is, once the chief exported it (a local path or a pod path)
    export: str | None = None
    #: a local run's directory (logs, checkpoints), or ``namespace/name`` on a cluster
    location: str | None = None

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Metrics:
    """The chief's progress and evaluations in order, as it printed them.

    :attr:`history` is shaped like Keras' ``History.history`` (one list per name), indexed by
    the progress lines (the chief prints at most one a second, so not every step)."""

    progress: tuple[events.Progress, ...] = ()
    evaluations: tuple[events.Eval, ...] = ()
    final: events.Final | None = None

    @property
    def history(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"step": [], "epoch": [], "loss": []}
        for p in self.progress:
            out["step"].append(p.step)
            out["epoch"].append(p.epoch)
            out["loss"].append(p.loss)
            for k, v in (p.outputs or {}).items():
                out.setdefault(k, []).append(v)
        if self.evaluations:
            out["eval_step"] = [e.step for e in self.evaluations]
            out["test_accuracy"] = [e.test_accuracy for e in self.evaluations]
            names = {k for e in self.evaluations for k in (e.test_metrics or {})}
            for k in sorted(names):
                out[f"test_{k}"] = [(e.test_metrics or {}).get(k) for e in self.evaluations]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "final": self.final.to_dict() if self.final else None,
        }


def fold_metrics(lines: Iterable[str]) -> Metrics:
    """The chief's output lines → :class:`Metrics`. A restarted chief prints its progress
    again from the checkpoint's step: a step at or below the last one starts the history
    there, as the job's progress does (:meth:`ringtrain_localrun.jobstate.JobState.new_gang`)."""
    progress: list[events.Progress] = []
    evaluations: list[events.Eval] = []
    final: events.Final | None = None
    for line in lines:
        e = events.parse_line(line)
        if isinstance(e, events.Progress):
            if isinstance(e.step, int):
                progress = [p for p in progress if isinstance(p.step, int) and p.step < e.step]
            progress.append(e)
        elif isinstance(e, events.Eval):
            evaluations.append(e)
        elif isinstance(e, events.Final):
            final = e
    return Metrics(tuple(progress), tuple(evaluations), final)
