"""A job's kind — a ring job or an MPI job — as one strategy object, chosen once per job.

Why: the two kinds share the whole lifecycle (restarts in place, backoff, deadlines, suspend,
cleanPodPolicy, TTL) and differ in a handful of answers: which objects the pods need first, how
a pod is built, who may wait before it is created, whose exit is the job's outcome, who reports
progress, what a restart in place means. Each difference is one field of :class:`Kind`; the
reconcile and the lifecycle fold ask ``kind.<field>`` and never test ``job.mpi`` themselves.
:func:`of` is the one place that looks at ``spec.mpi``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from . import manifests, mpi, networkpolicy
from .job import Job, ReplicaSpec
from .observe import ObservedPod

#: the MPI launcher's role (mpi-operator's name); a ring job has none
LAUNCHER = mpi.LAUNCHER


@dataclass(frozen=True)
class Kind:
    """What differs between a ring job and an MPI job."""

    #: the objects the pods need, created once before the first pod
    job_objects: Callable[[Job], list[dict]]
    pod: Callable[[Job, ReplicaSpec, int], dict]
    network_policy: Callable[[Job, networkpolicy.Settings], dict]
    #: every object, secrets empty, as ``ringtrain render`` prints them
    rendered: Callable[[Job], list[dict]]
    #: why the member of role :attr:`waiting_role` is not created yet, or None
    waits: Callable[[Job, Mapping[str, ObservedPod]], str | None]
    waiting_role: str | None
    waiting_reason: str
    #: the pods whose success is the job's, or None: spec.runPolicy.successPolicy decides
    outcome: Callable[[Job], list[str] | None]
    #: the pod whose progress and final result the job's status shows
    reporter: Callable[[Job, Iterable[ObservedPod]], ObservedPod | None]
    #: what a restart in place does, for the Restarting condition's message
    restart_note: str


def _chief(job: Job, pods: Iterable[ObservedPod]) -> ObservedPod | None:
    return next((p for p in pods if (p.role, p.index) == job.chief), None)


def _launcher_or_chief(job: Job, pods: Iterable[ObservedPod]) -> ObservedPod | None:
    """An MPI job's rank 0 runs in worker 0 (its live ``/status``); its final result is the
    launcher's termination message (``.mpilaunch``)."""
    pods = list(pods)
    done = next((p for p in pods if p.role == LAUNCHER and p.termination_message), None)
    return done if done is not None else _chief(job, pods)


RING = Kind(
    job_objects=lambda job: [manifests.service(job), manifests.secret(job)],
    pod=manifests.pod,
    network_policy=networkpolicy.network_policy,
    rendered=lambda job: manifests.desired_objects(job, token=""),
    waits=lambda job, live: None,
    waiting_role=None,
    waiting_reason="",
    outcome=lambda job: None,
    reporter=_chief,
    restart_note="its peers rejoin the ring",
)

MPI = Kind(
    job_objects=mpi.job_objects,
    pod=mpi.pod,
    network_policy=mpi.network_policy,
    rendered=lambda job: mpi.desired_objects(job, key_pair=(b"", b"")),
    waits=mpi.launcher_wait,
    waiting_role=LAUNCHER,
    waiting_reason=mpi.REASON_WAITING,
    # mpi-operator's rule: the job's outcome is the launcher's
    outcome=lambda job: [job.pod_name(LAUNCHER, 0)],
    reporter=_launcher_or_chief,
    restart_note="mpirun starts every rank again from the last checkpoint",
)


def of(job: Job) -> Kind:
    """The job's kind: MPI when ``spec.mpi`` is set, else a ring job."""
    return MPI if job.mpi is not None else RING
