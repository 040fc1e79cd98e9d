"""What the operator sees of a job: its Pods as :class:`ObservedPod`, and the chief's progress.

Parsing Pod objects lives here, next to the only I/O the observation needs (the chief's
``/status``), so the fold in :mod:`.status` reads plain values and never a Kubernetes object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ringtrain import events

from . import manifests
from .spec import Job

LiveStatusFetcher = Callable[[str], "Mapping[str, Any] | None"]


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


def observe_pods(job: Job | None, objs: Iterable[Mapping[str, Any]],
                 fetch: LiveStatusFetcher) -> list[ObservedPod]:
    """The job's Pod objects as ObservedPods (unlabelled ones skipped), the running chief's
    ``/status`` attached when the job runs ringtrain's trainer (``job`` None: spec invalid)."""
    observed = [o for p in objs if (o := ObservedPod.from_pod(p)) is not None]
    if job is None:
        return observed
    return [with_live_status(job, p, fetch) for p in observed]


def with_live_status(job: Job, p: ObservedPod, fetch: LiveStatusFetcher) -> ObservedPod:
    """Progress comes from the chief's own HTTP endpoint while it runs (no API rights needed)."""
    if (p.role, p.index) != job.chief or p.phase != "Running" or not p.pod_ip or not job.trainer:
        return p
    return dataclasses.replace(p, live_status=fetch(p.pod_ip))


def fetch_live_status(pod_ip: str, timeout_s: float = 1.0) -> Mapping[str, Any] | None:
    """The chief's JSON ``/status``; None when it does not answer (yet)."""
    st = events.fetch_status(f"http://{pod_ip}:{manifests.METRICS_PORT}/status", timeout_s)
    return None if st is None else st.to_dict()


#: trainer JSON key (a field of ringtrain.events.Status or .Final) → status.progress key
_PROGRESS_KEYS = {"step": "step", "steps": "step", "epoch": "epoch", "loss": "loss",
                  "samples_per_s": "samplesPerSecond", "test_accuracy": "testAccuracy",
                  "checkpoint": "checkpoint", "trace": "trace"}


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
        elif isinstance(v, str) and target in ("checkpoint", "trace"):
            out[target] = v
    waiting = (doc or {}).get("waiting_for")
    if isinstance(waiting, list) and waiting:
        out["waitingFor"] = [str(w) for w in waiting]
    return out


def chief_progress(job: Job, pods: Iterable[ObservedPod]) -> dict:
    """status.progress fields from the chief: its final termination message once it has one
    (the last word, written as the trainer exits), else its live ``/status``."""
    chief = next((p for p in pods if (p.role, p.index) == job.chief), None)
    if chief is None:
        return {}
    doc: Mapping[str, Any] | None = chief.live_status
    if chief.termination_message:
        try:
            final = json.loads(chief.termination_message)
        except ValueError:
            final = None
        if isinstance(final, dict):
            doc = final
    return read_progress(doc)
