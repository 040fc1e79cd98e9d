"""The lifecycle's vocabulary and working state: states, reasons, the Decision, the fold's scratch.

Pipeline position: :mod:`.lifecycle` folds observed pods into a :class:`Decision` through the
phases of :mod:`.phases`, both writing into a :class:`Fold` over a :class:`Seen` observation;
reconcile, the local runner and the metrics read the states and reasons named here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from . import restarts, statusbound, verdicts
from .job import Job, ReplicaSpec
from .kinds import Kind
from .observe import ObservedPod

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
#: a worker exited EXIT_DIVERGED: a non-finite loss, gradient or parameter (issue 20)
REASON_DIVERGED = "TrainingDiverged"
#: an object under the job's names is not the job's; the API server refused one for good
#: (issue 35: :mod:`.verdicts`)
REASON_RESOURCE_EXISTS = verdicts.REASON_RESOURCE_EXISTS
REASON_CREATE_REFUSED = verdicts.REASON_CREATE_REFUSED

PERMANENT_EXIT_CODES = restarts.PERMANENT_EXIT_CODES


#: Reasons of the Events that the reconciler's own actions and failures add.
REASON_POD_CREATED = "PodCreated"
REASON_POD_DELETED = "PodDeleted"
REASON_RECONCILE_FAILED = "ReconcileFailed"

#: When to look at a job again, by state, unless its deadline or TTL comes sooner: a live job's
#: chief is polled for progress; a finished or suspended job sleeps until something changes.
LOOK_AGAIN_S = {CREATED: 5.0, RUNNING: 5.0, RESTARTING: 5.0}
#: Seconds before a reconcile that failed (an API error, a bug) is tried again.
ERROR_RETRY_S = 5.0
#: Consecutive failed reconciles of one job back off, doubling from ERROR_RETRY_S to this: a
#: job that fails every reconcile the same way (a spec the API server refuses, a bug) costs the
#: operator and the API server one try in 5 minutes, not one in 5 s forever (issue 20).
ERROR_RETRY_MAX_S = 300.0


def error_retry_s(failures: int) -> float:
    """The wait after the ``failures``-th failed reconcile in a row: 5, 10, 20 … 300 s."""
    return min(ERROR_RETRY_S * 2.0 ** min(max(failures, 1) - 1, 16), ERROR_RETRY_MAX_S)


def warn_again(failures: int) -> bool:
    """Post the failure's Warning Event on the 1st, 2nd, 4th, 8th … failure in a row only."""
    return failures & (failures - 1) == 0


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" or "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class Member:
    """One member of the gang: the name of its pod, its replica spec and its index."""

    name: str
    replica: ReplicaSpec
    index: int


def members(job: Job) -> dict[str, Member]:
    """The gang by pod name, in TF_CONFIG order."""
    return {
        job.pod_name(r.role, i): Member(job.pod_name(r.role, i), r, i) for r, i in job.members()
    }


@dataclass(frozen=True)
class Decision:
    """The new status and what to do: the members whose pods to create, pod names to delete."""

    status: dict
    to_create: tuple[Member, ...] = ()
    delete: tuple[str, ...] = ()
    delete_job: bool = False
    events: tuple[Event, ...] = ()
    #: (pod name, value) of an elastic job's size annotation to patch onto pods that stay
    annotate: tuple[tuple[str, str], ...] = ()
    #: Look again after this long at the latest (deadline, TTL), even if nothing changes.
    requeue_after_s: float | None = None
    #: A pod of the job runs, so its progress can change unseen by any watch: poll it at the
    #: state's :data:`LOOK_AGAIN_S`. Without one, only a pod event, the spec or a deadline can
    #: change the decision, and 10,000 pending jobs cost nothing while they wait (issue 22).
    polls: bool = True

    @property
    def create(self) -> tuple[str, ...]:
        """The names of the pods to create."""
        return tuple(m.name for m in self.to_create)


def look_again_s(decision: Decision) -> float | None:
    """The one requeue policy: seconds until the job is looked at again even if nothing changes
    (the sooner of its state's poll and its deadline/TTL); None: only a change wakes it."""
    poll = LOOK_AGAIN_S.get(str(decision.status.get("state")), math.inf)
    t = min(decision.requeue_after_s or math.inf, poll if decision.polls else math.inf)
    return None if t == math.inf else max(t, 0.05)


def format_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


@dataclass
class Fold:
    """Working state of one derivation; discarded when the Decision is built."""

    job: Job | None
    now: datetime
    status: dict
    create: list[Member] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    annotate: list[tuple[str, str]] = field(default_factory=list)
    delete_job: bool = False
    requeue: list[float] = field(default_factory=list)
    #: status.restarts as the previous derivation left it: more now means a new restart.
    restarts_before: int = 0
    polls: bool = True

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
                    c.update(
                        status=value,
                        reason=reason,
                        message=message,
                        lastUpdateTime=format_time(self.now),
                    )
                return
        if true:
            t = format_time(self.now)
            conds.append(
                {
                    "type": ctype,
                    "status": value,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": t,
                    "lastUpdateTime": t,
                }
            )

    def clear(self, *ctypes: str, reason: str, message: str) -> None:
        for ctype in ctypes:
            if any(
                c["type"] == ctype and c["status"] == "True"
                for c in self.status.get("conditions", [])
            ):
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
            if policy == "All" or (
                policy == "Running" and p.phase in ("Pending", "Running", "Unknown")
            ):
                self.delete.append(p.name)
        ttl = self.job.run_policy.ttl_after_finished_s if self.job else None
        if ttl is not None and "completionTime" in self.status:
            left = (
                parse_time(self.status["completionTime"]) + timedelta(seconds=ttl) - self.now
            ).total_seconds()
            if left <= 0:
                self.delete_job = True
            else:
                self.requeue.append(left)

    def decision(self) -> Decision:
        """The Decision, its status within :data:`.statusbound.STATUS_MAX_BYTES` whatever the
        workers said (the one place every derivation's status passes)."""
        return Decision(
            status=statusbound.bounded(self.status),
            to_create=tuple(self.create),
            delete=tuple(dict.fromkeys(self.delete)),
            delete_job=self.delete_job,
            events=tuple(self.events),
            annotate=tuple(self.annotate),
            requeue_after_s=min(self.requeue) if self.requeue else None,
            polls=self.polls,
        )


@dataclass(frozen=True)
class Seen:
    """The observation one derivation works on."""

    pods: list[ObservedPod]  # deleting ones included
    live: list[ObservedPod]  # not being deleted
    desired: dict[str, Member]
    #: ring or MPI, chosen once per derivation (``kinds.of``)
    kind: Kind
