"""The phases of the lifecycle fold, in the order ``lifecycle.derive_status`` runs them.

Each phase reads the observation (``status.Seen``) and edits the working status
(``status.Fold``); the first that settles the job ends the derivation. How a single member's
failure is judged lives in :mod:`.restarts`; the vocabulary (states, reasons, the Decision) in
:mod:`.status`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta

from ringtrain import errors

from . import resizing, restarts
from .job import Job
from .kinds import LAUNCHER
from .observe import ObservedPod
from .restarts import describe_exit as _exit
from .status import (
    CREATED,
    REASON_BACKOFF,
    REASON_CREATED,
    REASON_DEADLINE,
    REASON_DIVERGED,
    REASON_FAILED,
    REASON_INVALID,
    REASON_RESTARTING,
    REASON_RESUMED,
    REASON_RUNNING,
    REASON_SUCCEEDED,
    REASON_SUSPENDED,
    RESTARTING,
    RUNNING,
    SUSPENDED,
    TERMINAL,
    Fold,
    Seen,
    format_time,
    parse_time,
)


def _finished(f: Fold, job: Job, seen: Seen) -> bool:
    """A terminal job stays terminal and keeps applying cleanPodPolicy and its TTL; its restarts
    are those it had when it ended (a pod left by cleanPodPolicy None may restart on)."""
    if f.state not in TERMINAL:
        return False
    f.status["restarts"] = f.restarts_before
    f.terminal(seen.live)
    return True


def _kind_changed(f: Fold, job: Job, seen: Seen) -> bool:
    """A job with a launcher pod but no spec.mpi was an MPI job: re-applying a CRD without
    spec.mpi makes the API server prune it (and the Launcher) from the stored job, which would
    then pass for a ring job of sshd workers that never train. A ring job never has a launcher
    (a Launcher without spec.mpi is refused), so the job fails, naming the field."""
    if seen.kind.waiting_role == LAUNCHER:
        return False
    launchers = [p.name for p in seen.live if p.role == LAUNCHER]
    if not launchers:
        return False
    f.finish(
        False,
        REASON_INVALID,
        f"spec.mpi: missing, but pod {launchers[0]} is this job's MPI launcher: the job was "
        "created as an MPI job and cannot go on as a ring job (a CustomResourceDefinition "
        "without spec.mpi prunes it from stored jobs: apply ringtrain's current CRD, then "
        "the job again)",
        seen.live,
    )
    return True


def _suspended(f: Fold, job: Job, seen: Seen) -> bool:
    """suspend deletes the pods; on resume the job starts again as Created."""
    if job.run_policy.suspend:
        _suspend(f, seen.live)
        return True
    if f.state == SUSPENDED:
        f.condition(SUSPENDED, False, REASON_RESUMED, "resumed: pods are recreated")
        f.emit(False, REASON_RESUMED, "TrainingJob resumed")
        f.status.pop("startTime", None)  # a resumed job's deadline starts again
        f.status["state"] = CREATED
    return False


def _old_pods(f: Fold, job: Job, seen: Seen) -> bool:
    """Pods of replicas scaled down go. (No gang is ever deleted to restart: see the module.)"""
    keep = resizing.kept(f, job)  # an elastic job's lost worker, pending its node
    f.delete += [p.name for p in seen.live if p.name not in seen.desired and p.name not in keep]
    return False


def _deadline(f: Fold, job: Job, seen: Seen) -> bool:
    """activeDeadlineSeconds after startTime: Failed; until then, a wake-up when it is due."""
    deadline = job.run_policy.active_deadline_s
    if deadline is None or "startTime" not in f.status:
        return False
    left = parse_time(f.status["startTime"]) + timedelta(seconds=deadline) - f.now
    if left.total_seconds() > 0:
        f.requeue.append(left.total_seconds())
        return False
    f.finish(
        False,
        REASON_DEADLINE,
        f"TrainingJob ran longer than activeDeadlineSeconds={deadline}",
        seen.live,
    )
    return True


def _failures(f: Fold, job: Job, seen: Seen) -> bool:
    """The first failed member in TF_CONFIG order decides: a permanent failure, or a lost pod
    replaced within backoffLimit. Then restarts in place: each counts, the first beyond
    backoffLimit fails the job, and a new one shows as Restarting."""
    order = {name: i for i, name in enumerate(seen.desired)}
    ordered = sorted((p for p in seen.live if p.name in order), key=lambda p: order[p.name])
    limit = job.run_policy.backoff_limit
    for p in ordered:
        replica = seen.desired[p.name].replica
        verdict = restarts.judge(replica, p)
        if verdict == "permanent":
            f.status["restarts"] -= sum(q.restarting for q in ordered)  # they will not happen
            # exit 3 means "diverged" only from ringtrain's own trainer; a user's script may
            # exit 3 for reasons of its own
            diverged = job.trainer is not None and restarts.exit_code(p) == errors.EXIT_DIVERGED
            f.finish(
                False,
                REASON_DIVERGED if diverged else REASON_FAILED,
                f"pod {p.name} failed with {_exit(p)}: permanent "
                f"under restartPolicy {replica.restart_policy}{_why(p)}",
                seen.live,
            )
            return True
        if verdict == "replace":
            _replace(f, job, p, seen.live)
            return True
    pending = [p for p in ordered if p.restarting]
    before = f.status["restarts"] - len(pending)  # _count counted the pending restarts
    for i, p in enumerate(pending):
        if before + i >= limit:
            f.status["restarts"] = before + i  # restarts that will not happen do not count
            f.finish(
                False,
                REASON_BACKOFF,
                f"pod {p.name} failed with {_exit(p)} and "
                f"{before + i} restarts reached backoffLimit={limit}{_why(p)}",
                seen.live,
            )
            return True
    if f.status["restarts"] > limit:
        # restarts seen only afterwards (restartCount): name the likely cause, an OOMKilled too
        causes = restarts.likely_causes(ordered)
        who = f"pod {causes[0].name} failed with {_exit(causes[0])}: " if causes else ""
        f.finish(
            False,
            REASON_BACKOFF,
            f"{who}{f.status['restarts']} restarts exceed backoffLimit={limit}"
            + (_why(causes[0]) if causes else ""),
            seen.live,
        )
        return True
    if f.status["restarts"] > f.restarts_before:
        _in_place(f, job, seen, pending or restarts.likely_causes(ordered))
        return True
    return False


def _success(f: Fold, job: Job, seen: Seen) -> bool:
    if not _succeeded(job, seen, {p.name: p for p in seen.live}):
        return False
    f.finish(True, REASON_SUCCEEDED, "TrainingJob completed successfully", seen.live)
    return True


def _running(f: Fold, job: Job, seen: Seen) -> bool:
    """Create the missing members' pods (a replaced one once the old is gone): Created, or
    Restarting, until every member's pod is up and no container waits for its restart."""
    present = {p.name for p in seen.pods}
    live = {p.name: p for p in seen.live}
    wait = seen.kind.waits(job, live)  # an MPI job's launcher waits for its workers' sshd
    f.create += [
        m
        for name, m in seen.desired.items()
        if name not in present and not (wait and m.replica.role == seen.kind.waiting_role)
    ]
    f.status.setdefault("startTime", format_time(f.now))
    if f.state is None:
        f.condition(CREATED, True, REASON_CREATED, f"{len(seen.desired)} pods created")
        f.emit(False, REASON_CREATED, f"TrainingJob created: {len(seen.desired)} pods")
        f.status["state"] = CREATED
    waiter = seen.kind.waiting_role
    if wait:
        f.condition(CREATED, True, seen.kind.waiting_reason, wait)
    elif waiter and f.state == CREATED and job.pod_name(waiter, 0) in present:
        f.condition(CREATED, True, REASON_CREATED, f"{len(seen.desired)} pods created")
    all_up = all(
        n in live and live[n].phase in ("Running", "Succeeded") and not live[n].restarting
        for n in seen.desired
    )
    if all_up and f.state != RUNNING:
        f.status["state"] = RUNNING
        f.condition(RUNNING, True, REASON_RUNNING, "all pods are running")
        f.clear(RESTARTING, reason=REASON_RUNNING, message="all pods are running")
        f.emit(False, REASON_RUNNING, "all pods are running")
    return True


def _why(p: ObservedPod) -> str:
    """``": <the worker's own words>"`` from its termination message, for every failure
    (issue 34): the ``error`` of ringtrain's JSON record, or a plain-text message's last
    :data:`restarts.ERROR_CHARS` characters, its lines joined by `` | ``; "" without either (a
    JSON result is no reason)."""
    text = restarts.failure_message(p)
    if not text:
        return ""
    try:
        json.loads(text)
    except ValueError:
        lines = " | ".join(line.strip() for line in text.splitlines() if line.strip())
        tail = lines[-restarts.ERROR_CHARS :]
        return f": {'…' if len(tail) < len(lines) else ''}{tail}"
    error = restarts.last_error(p)
    return f": {error}" if error else ""


def _announce(f: Fold, message: str) -> None:
    f.status["state"] = RESTARTING
    f.condition(RESTARTING, True, REASON_RESTARTING, message)
    f.clear(RUNNING, reason=REASON_RESTARTING, message=message)
    f.emit(True, REASON_RESTARTING, message)


def _replace(f: Fold, job: Job, culprit: ObservedPod, live: list[ObservedPod]) -> None:
    """A lost pod is deleted, then recreated once gone (see _running); the others stay."""
    limit = job.run_policy.backoff_limit
    if f.status["restarts"] >= limit:
        f.finish(
            False,
            REASON_BACKOFF,
            f"pod {culprit.name} failed with {_exit(culprit)} and "
            f"{f.status['restarts']} restarts reached backoffLimit={limit}{_why(culprit)}",
            live,
        )
        return
    f.status["gangRestarts"] = f.status.get("gangRestarts", 0) + 1
    f.status["priorContainerRestarts"] = (
        f.status.get("priorContainerRestarts", 0) + culprit.restarts + culprit.restarting
    )
    f.status["restarts"] += 1
    _announce(
        f,
        f"pod {culprit.name} failed with {_exit(culprit)}: recreating it, the "
        f"other pods restart in place (restart {f.status['restarts']} of {limit})",
    )
    f.delete.append(culprit.name)


def _in_place(f: Fold, job: Job, seen: Seen, culprits: list[ObservedPod]) -> None:
    """New container restarts: the kubelet restarts them in place, the ring re-forms (an MPI
    job's launcher runs mpirun again, its ranks resume from the last checkpoint)."""
    who = (
        f"pod {culprits[0].name} failed with {_exit(culprits[0])}"
        if culprits
        else "a container failed"
    )
    then = seen.kind.restart_note
    _announce(
        f,
        f"{who}: restarting in place, {then} (restart "
        f"{f.status['restarts']} of {job.run_policy.backoff_limit})",
    )


def _suspend(f: Fold, live: list[ObservedPod]) -> None:
    if f.state != SUSPENDED:
        f.status["state"] = SUSPENDED
        f.condition(SUSPENDED, True, REASON_SUSPENDED, "spec.runPolicy.suspend is true")
        f.clear(RUNNING, RESTARTING, reason=REASON_SUSPENDED, message="suspended")
        f.emit(False, REASON_SUSPENDED, "TrainingJob suspended: its pods are deleted")
    f.delete += [p.name for p in live]


def _succeeded(job: Job, seen: Seen, live: Mapping[str, ObservedPod]) -> bool:
    """successPolicy's pods, and the built-in trainer's evaluator (it exits 0 after the last
    checkpoint; cleanPodPolicy would delete it first). A stock one may never exit (Kubeflow)."""
    outcome = seen.kind.outcome(job)
    if outcome is not None:
        names = outcome
    elif job.run_policy.success_policy == "AllWorkers":
        names = [job.pod_name(r.role, i) for r, i in job.members() if r.role in ("chief", "worker")]
    else:
        names = [job.pod_name(*job.chief)]
    if job.trainer:
        names += [job.pod_name(r.role, i) for r, i in job.members() if r.role == "evaluator"]
    return all(n in live and live[n].phase == "Succeeded" for n in names)


PHASES = (
    _finished,
    _kind_changed,
    _suspended,
    resizing.phase,
    _old_pods,
    _deadline,
    _failures,
    _success,
    _running,
)


def run(f: Fold, job: Job, seen: Seen) -> None:
    """Run the phases in order until one settles the job."""
    for phase in PHASES:
        if phase(f, job, seen):
            return
