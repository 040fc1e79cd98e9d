"""The job lifecycle as one pure fold: (spec, observed pods, now, previous status) → decision.

Every path — start, restart in place, pod replacement, backoff, deadline, suspend/resume,
success, failure, cleanup, TTL — goes through :func:`derive_status`, so the Kubeflow pattern of
copy-pasted success and failure blocks (and their bug of skipping ``cleanPodPolicy`` on some of
them) cannot recur.
The caller observes the cluster, writes the returned status *first* (so a restart is counted
once even if the operator dies next), then carries out the returned actions.

Restarts happen in place (JobSet-style): every pod runs under restartPolicy OnFailure/Always
except under Never, so a failed container is restarted by its kubelet inside its pod, keeps
its ``emptyDir`` volumes (the chief's checkpoint), and its peers leave the broken ring (exit
138) and restart in theirs. The fold only reads what the kubelet did: a permanent exit code
(``ExitCode``: 1–127) seen in a container's current or last termination fails the job, every
container restart counts against backoffLimit, and only a pod that is itself lost (phase Failed:
evicted, node lost) is deleted and recreated, alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from . import kinds, observe, phases, statusbound
from .job import Job
from .observe import ObservedPod
from .status import (
    REASON_INVALID,
    REASON_RUNNING,
    RUNNING,
    TERMINAL,
    Decision,
    Fold,
    Seen,
    members,
)


def derive_status(
    job: Job, pods: Iterable[ObservedPod], now: datetime, previous: Mapping[str, Any] | None
) -> Decision:
    """Fold what is observed into the job's next status and the actions that lead there.

    The phases run in order and the first that settles the job ends the derivation."""
    f = Fold(job, now, copy.deepcopy(dict(previous or {})))
    f.restarts_before = int(f.status.get("restarts", 0))
    f.status["observedGeneration"] = job.generation
    pods = list(pods)
    seen = Seen(pods, [p for p in pods if not p.deleting], members(job), kinds.of(job))
    f.polls = any(p.phase == "Running" for p in seen.pods)
    _count(f, job, seen.live)
    _progress(f, job, seen)
    phases.run(f, job, seen)
    return f.decision()


def derive_invalid(
    pods: Iterable[ObservedPod],
    now: datetime,
    previous: Mapping[str, Any] | None,
    message: str,
    generation: int,
) -> Decision:
    """A spec that cannot run: Failed with reason InvalidSpec, its pods (if any) removed."""
    f = Fold(None, now, copy.deepcopy(dict(previous or {})))
    f.status["observedGeneration"] = generation
    live = [p for p in pods if not p.deleting]
    if f.state in TERMINAL:
        f.terminal(live)
    else:
        f.status.setdefault("restarts", 0)
        f.status.setdefault("workers", "0/0")
        f.finish(False, REASON_INVALID, message, live)
    return f.decision()


def derive_refused(
    job: Job,
    pods: Iterable[ObservedPod],
    now: datetime,
    previous: Mapping[str, Any] | None,
    reason: str,
    message: str,
) -> Decision:
    """A job whose objects cannot be created (someone else's under its names, a permanent
    refusal of the API server: :mod:`.verdicts`): Failed with ``reason`` and ``message``, one
    Warning Event, its pods cleaned up as any failed job's."""
    f = Fold(job, now, copy.deepcopy(dict(previous or {})))
    live = [p for p in pods if not p.deleting]
    if f.state in TERMINAL:
        f.terminal(live)
    else:
        f.finish(False, reason, message, live)
    return f.decision()


def _count(f: Fold, job: Job, live: list[ObservedPod]) -> None:
    """replicaStatuses, the printer columns' workers and restarts."""
    replica_statuses = {}
    for r in job.replicas:
        mine = [p for p in live if p.role == r.role]
        replica_statuses[r.key] = {
            "active": sum(p.phase in ("Pending", "Running") for p in mine),
            "succeeded": sum(p.phase == "Succeeded" for p in mine),
            "failed": sum(p.phase == "Failed" for p in mine),
            "restarts": sum(p.restarts for p in mine),
        }
    f.status["replicaStatuses"] = replica_statuses
    f.status["workers"] = f"{sum(p.ready for p in live)}/{len(job.members())}"
    f.status["restarts"] = (
        f.status.get("gangRestarts", 0)
        + f.status.get("priorContainerRestarts", 0)
        + sum(p.restarts + p.restarting for p in live)
    )


#: progress fields that say something of the last reply only: never carried over
_FRESH = ("waitingFor", statusbound.TRUNCATED)


def _progress(f: Fold, job: Job, seen: Seen) -> None:
    """Merge the chief's progress; ``waitingFor`` (ring members the chief still waits for at
    start-up) is never carried over, and names them in the Running condition's message."""
    if update := observe.progress_of(seen.kind.reporter(job, seen.pods)):
        old = {k: v for k, v in f.status.get("progress", {}).items() if k not in _FRESH}
        f.status["progress"] = {**old, **update}
        waiting = update.get("waitingFor")
        if f.state == RUNNING and any(
            c.get("type") == RUNNING and c.get("status") == "True"
            for c in f.status.get("conditions", [])
        ):
            f.condition(
                RUNNING,
                True,
                REASON_RUNNING,
                f"waiting for {', '.join(waiting)}" if waiting else "all pods are running",
            )
    if update := observe.evaluation(job, seen.pods):
        old = {k: v for k, v in f.status.get("evaluation", {}).items() if k not in _FRESH}
        f.status["evaluation"] = {**old, **update}
