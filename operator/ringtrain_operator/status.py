"""The job lifecycle as one pure fold: (spec, observed pods, now, previous status) → decision.

Every path — start, gang restart, backoff, deadline, suspend/resume, success, failure, cleanup,
TTL — goes through :func:`derive_status`, so the Kubeflow pattern of copy-pasted success and
failure blocks (and their bug of skipping ``cleanPodPolicy`` on some of them) cannot recur.
The caller observes the cluster, writes the returned status *first* (so a gang restart is counted
once even if the operator dies next), then carries out the returned actions.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping

from . import manifests
from .spec import Job, ReplicaSpec

# States (status.state) are also the condition types.
CREATED, RUNNING, RESTARTING = "Created", "Running", "Restarting"
SUCCEEDED, FAILED, SUSPENDED = "Succeeded", "Failed", "Suspended"
TERMINAL = (SUCCEEDED, FAILED)

# Reasons: on conditions and on the Events that announce them.
REASON_CREATED = "TrainingJobCreated"
REASON_RUNNING = "TrainingJobRunning"
REASON_RESTARTING = "TrainingJobRestarting"
REASON_SUCCEEDED = "TrainingJobSucceeded"
REASON_FAILED = "TrainingJobFailed"
REASON_SUSPENDED = "TrainingJobSuspended"
REASON_RESUMED = "TrainingJobResumed"
REASON_DEADLINE = "DeadlineExceeded"
REASON_BACKOFF = "BackoffLimitExceeded"
REASON_INVALID = "InvalidSpec"

#: Exit codes the ExitCode policy treats as permanent (the user must fix something).
PERMANENT_EXIT_CODES = range(1, 128)


@dataclass(frozen=True)
class ObservedPod:
    """What the fold needs to know about one pod of the job (see :meth:`from_pod`)."""

    name: str
    role: str
    index: int
    phase: str = "Pending"
    ready: bool = False
    restarts: int = 0
    exit_code: int | None = None
    exit_reason: str | None = None
    deleting: bool = False
    termination_message: str | None = None
    pod_ip: str | None = None
    #: The chief's JSON ``/status`` (fetched by the caller; pods get no API permissions).
    live_status: Mapping[str, Any] | None = None

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> "ObservedPod | None":
        """Read a Pod object; ``None`` when it lacks ringtrain's role/index labels."""
        meta = pod.get("metadata") or {}
        lab = meta.get("labels") or {}
        role, index = lab.get(manifests.LABEL_ROLE), lab.get(manifests.LABEL_INDEX)
        if not role or not str(index).isdigit():
            return None
        st = pod.get("status") or {}
        cstats = st.get("containerStatuses") or []
        main = next((c for c in cstats if c.get("name") == manifests.MAIN_CONTAINER),
                    cstats[0] if cstats else {})
        term = (main.get("state") or {}).get("terminated") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in st.get("conditions") or [])
        return cls(
            name=meta.get("name", ""),
            role=role,
            index=int(index),
            phase=st.get("phase") or "Pending",
            ready=ready,
            restarts=sum(int(c.get("restartCount") or 0) for c in cstats),
            exit_code=term.get("exitCode"),
            exit_reason=term.get("reason") or st.get("reason"),
            deleting=bool(meta.get("deletionTimestamp")),
            termination_message=term.get("message"),
            pod_ip=st.get("podIP"),
        )


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" or "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """The new status and what to do; ``create``/``delete`` are pod names."""

    status: dict
    create: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    delete_job: bool = False
    events: tuple[Event, ...] = ()
    #: Look again after this long at the latest (deadline, TTL), even if nothing changes.
    requeue_after_s: float | None = None


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


@dataclass
class _Fold:
    """Working state of one derivation; discarded when the Decision is built."""

    job: Job | None
    now: datetime
    status: dict
    create: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    requeue: list[float] = field(default_factory=list)

    @property
    def state(self) -> str | None:
        return self.status.get("state")

    def condition(self, ctype: str, true: bool, reason: str, message: str) -> None:
        """Set a condition; lastTransitionTime moves only when its status flips."""
        conds = self.status.setdefault("conditions", [])
        value = "True" if true else "False"
        for c in conds:
            if c["type"] == ctype:
                if c["status"] != value:
                    c["lastTransitionTime"] = format_time(self.now)
                if (c["status"], c.get("reason"), c.get("message")) != (value, reason, message):
                    c.update(status=value, reason=reason, message=message,
                             lastUpdateTime=format_time(self.now))
                return
        if true:
            t = format_time(self.now)
            conds.append({"type": ctype, "status": value, "reason": reason, "message": message,
                          "lastTransitionTime": t, "lastUpdateTime": t})

    def clear(self, *ctypes: str, reason: str, message: str) -> None:
        for ctype in ctypes:
            if any(c["type"] == ctype and c["status"] == "True"
                   for c in self.status.get("conditions", [])):
                self.condition(ctype, False, reason, message)

    def emit(self, warning: bool, reason: str, message: str) -> None:
        self.events.append(Event("Warning" if warning else "Normal", reason, message))

    def finish(self, success: bool, reason: str, message: str, live: list[ObservedPod]) -> None:
        """Enter a terminal state: the one place that does it, cleanup included."""
        state = SUCCEEDED if success else FAILED
        self.status["state"] = state
        self.condition(state, True, reason, message)
        self.clear(RUNNING, RESTARTING, reason=reason, message=message)
        self.status["completionTime"] = format_time(self.now)
        self.emit(not success, reason, message)
        self.terminal(live)

    def terminal(self, live: list[ObservedPod]) -> None:
        """What a finished job keeps doing: cleanPodPolicy, then TTL."""
        policy = self.job.run_policy.clean_pod_policy if self.job else "All"
        for p in live:
            if policy == "All" or (policy == "Running" and p.phase in ("Pending", "Running",
                                                                        "Unknown")):
                self.delete.append(p.name)
        ttl = self.job.run_policy.ttl_after_finished_s if self.job else None
        if ttl is not None and "completionTime" in self.status:
            left = (parse_time(self.status["completionTime"]) + timedelta(seconds=ttl)
                    - self.now).total_seconds()
            if left <= 0:
                self.delete_job = True
            else:
                self.requeue.append(left)

    def decision(self) -> Decision:
        return Decision(
            status=self.status,
            create=tuple(self.create),
            delete=tuple(dict.fromkeys(self.delete)),
            delete_job=self.delete_job,
            events=tuple(self.events),
            requeue_after_s=min(self.requeue) if self.requeue else None,
        )


def derive_status(job: Job, pods: Iterable[ObservedPod], now: datetime,
                  previous: Mapping[str, Any] | None) -> Decision:
    """Fold what is observed into the job's next status and the actions that lead there."""
    f = _Fold(job, now, copy.deepcopy(dict(previous or {})))
    f.status["observedGeneration"] = job.generation
    pods = list(pods)
    live = [p for p in pods if not p.deleting]
    desired = {job.pod_name(r.role, i): (r, i) for r, i in job.members()}
    _count(f, job, live)
    _progress(f, job, pods)

    if f.state in TERMINAL:
        f.terminal(live)
        return f.decision()
    if job.run_policy.suspend:
        _suspend(f, live)
        return f.decision()
    if f.state == SUSPENDED:
        f.condition(SUSPENDED, False, REASON_RESUMED, "resumed: pods are recreated")
        f.emit(False, REASON_RESUMED, "TrainingJob resumed")
        f.status.pop("startTime", None)  # a resumed job's deadline starts again
        f.status["state"] = CREATED
    if f.state == RESTARTING and pods:
        f.delete += [p.name for p in live]  # wait until the whole old gang is gone
        return f.decision()
    f.delete += [p.name for p in live if p.name not in desired]  # replicas scaled down

    deadline = job.run_policy.active_deadline_s
    if deadline is not None and "startTime" in f.status:
        left = (parse_time(f.status["startTime"]) + timedelta(seconds=deadline) - now)
        if left.total_seconds() <= 0:
            f.finish(False, REASON_DEADLINE,
                     f"TrainingJob ran longer than activeDeadlineSeconds={deadline}", live)
            return f.decision()
        f.requeue.append(left.total_seconds())

    ordered = sorted((p for p in live if p.name in desired),
                     key=lambda p: list(desired).index(p.name))
    for p in ordered:
        verdict = _judge(desired[p.name][0], p)
        if verdict == "permanent":
            f.finish(False, REASON_FAILED, f"pod {p.name} failed with {_exit(p)}: permanent "
                     f"under restartPolicy {desired[p.name][0].restart_policy}", live)
            return f.decision()
        if verdict == "retryable":
            _gang_restart(f, job, p, live)
            return f.decision()
    if f.status["restarts"] > job.run_policy.backoff_limit:
        f.finish(False, REASON_BACKOFF, f"{f.status['restarts']} restarts exceed backoffLimit="
                 f"{job.run_policy.backoff_limit}", live)
        return f.decision()

    if _succeeded(job, {p.name: p for p in live}):
        f.finish(True, REASON_SUCCEEDED, "TrainingJob completed successfully", live)
        return f.decision()

    present = {p.name for p in pods}
    f.create += [n for n in desired if n not in present]
    f.status.setdefault("startTime", format_time(now))
    if f.state is None:
        f.condition(CREATED, True, REASON_CREATED, f"{len(desired)} pods created")
        f.emit(False, REASON_CREATED, f"TrainingJob created: {len(desired)} pods")
        f.status["state"] = CREATED
    elif f.state == RESTARTING:  # the old gang is gone (see above): this is the new one
        f.status["state"] = CREATED
    all_up = not f.create and all(
        p.phase in ("Running", "Succeeded") for p in live if p.name in desired)
    if all_up and f.state != RUNNING:
        f.status["state"] = RUNNING
        f.condition(RUNNING, True, REASON_RUNNING, "all pods are running")
        f.clear(RESTARTING, reason=REASON_RUNNING, message="all pods are running")
        f.emit(False, REASON_RUNNING, "all pods are running")
    return f.decision()


def derive_invalid(pods: Iterable[ObservedPod], now: datetime,
                   previous: Mapping[str, Any] | None, message: str,
                   generation: int) -> Decision:
    """A spec that cannot run: Failed with reason InvalidSpec, its pods (if any) removed."""
    f = _Fold(None, now, copy.deepcopy(dict(previous or {})))
    f.status["observedGeneration"] = generation
    live = [p for p in pods if not p.deleting]
    if f.state in TERMINAL:
        f.terminal(live)
    else:
        f.status.setdefault("restarts", 0)
        f.status.setdefault("workers", "0/0")
        f.finish(False, REASON_INVALID, message, live)
    return f.decision()


def _exit(p: ObservedPod) -> str:
    if p.exit_code is None:
        return f"no exit code ({p.exit_reason or p.phase})"
    return f"exit code {p.exit_code}" + (f" ({p.exit_reason})" if p.exit_reason else "")


def _judge(replica: ReplicaSpec, p: ObservedPod) -> str | None:
    """None (carry on), "permanent" (fail the job) or "retryable" (restart the gang)."""
    if p.phase != "Failed":
        return None
    if replica.restart_policy == "Never":
        return "permanent"
    if replica.restart_policy == "ExitCode" and p.exit_code in PERMANENT_EXIT_CODES:
        return "permanent"
    # ExitCode with >= 128 or no code (evicted, node lost); OnFailure/Always pods that the
    # kubelet gave up on: recreate the whole gang, the ring cannot go on without a member.
    return "retryable"


def _gang_restart(f: _Fold, job: Job, culprit: ObservedPod, live: list[ObservedPod]) -> None:
    limit = job.run_policy.backoff_limit
    if f.status["restarts"] >= limit:
        f.finish(False, REASON_BACKOFF, f"pod {culprit.name} failed with {_exit(culprit)} and "
                 f"{f.status['restarts']} restarts reached backoffLimit={limit}", live)
        return
    f.status["gangRestarts"] = f.status.get("gangRestarts", 0) + 1
    f.status["priorContainerRestarts"] = (f.status.get("priorContainerRestarts", 0)
                                          + sum(p.restarts for p in live))
    f.status["restarts"] += 1
    f.status["state"] = RESTARTING
    message = (f"pod {culprit.name} failed with {_exit(culprit)}: restarting all "
               f"{len(job.members())} pods (restart {f.status['restarts']} of {limit})")
    f.condition(RESTARTING, True, REASON_RESTARTING, message)
    f.clear(RUNNING, reason=REASON_RESTARTING, message=message)
    f.emit(True, REASON_RESTARTING, message)
    f.delete += [p.name for p in live]


def _suspend(f: _Fold, live: list[ObservedPod]) -> None:
    if f.state != SUSPENDED:
        f.status["state"] = SUSPENDED
        f.condition(SUSPENDED, True, REASON_SUSPENDED, "spec.runPolicy.suspend is true")
        f.clear(RUNNING, RESTARTING, reason=REASON_SUSPENDED, message="suspended")
        f.emit(False, REASON_SUSPENDED, "TrainingJob suspended: its pods are deleted")
    f.delete += [p.name for p in live]


def _succeeded(job: Job, live: Mapping[str, ObservedPod]) -> bool:
    if job.run_policy.success_policy == "AllWorkers":
        names = [job.pod_name(r.role, i) for r, i in job.members() if r.role in ("chief", "worker")]
    else:
        names = [job.pod_name(*job.chief)]
    return all(n in live and live[n].phase == "Succeeded" for n in names)


def _count(f: _Fold, job: Job, live: list[ObservedPod]) -> None:
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
    f.status["restarts"] = (f.status.get("gangRestarts", 0)
                            + f.status.get("priorContainerRestarts", 0)
                            + sum(p.restarts for p in live))


#: trainer JSON key (a field of ringtrain.events.Status or .Final) → status.progress key
_PROGRESS_KEYS = {"step": "step", "steps": "step", "epoch": "epoch", "loss": "loss",
                  "samples_per_s": "samplesPerSecond", "test_accuracy": "testAccuracy",
                  "checkpoint": "checkpoint"}


def read_progress(doc: Mapping[str, Any] | None) -> dict:
    """The chief's ``/status`` (:class:`ringtrain.events.Status`) or final termination-log JSON
    (:class:`ringtrain.events.Final`) → status.progress fields."""
    out: dict[str, Any] = {}
    for key, target in _PROGRESS_KEYS.items():
        v = (doc or {}).get(key)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            continue  # NaN/inf are not JSON and the API would reject the status
        if isinstance(v, (int, float)):
            out[target] = round(v, 6) if isinstance(v, float) else v
        elif isinstance(v, str) and target == "checkpoint":
            out[target] = v
    return out


def _progress(f: _Fold, job: Job, pods: list[ObservedPod]) -> None:
    chief = next((p for p in pods if (p.role, p.index) == job.chief), None)
    if chief is None:
        return
    doc: Mapping[str, Any] | None = chief.live_status
    if chief.termination_message:
        try:
            final = json.loads(chief.termination_message)
        except ValueError:
            final = None
        if isinstance(final, dict):
            doc = final
    if update := read_progress(doc):
        f.status["progress"] = {**f.status.get("progress", {}), **update}
