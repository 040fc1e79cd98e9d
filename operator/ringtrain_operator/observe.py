"""What the operator sees of a job: its Pods as :class:`ObservedPod`, the chief's progress and
the evaluator's last evaluation.

Parsing Pod objects lives here, next to the only I/O the observation needs (the chief's
``/status``), so the fold in :mod:`.status` reads plain values and never a Kubernetes object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

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
    #: The main container stopped and its kubelet will start it again in this pod (pod
    #: restartPolicy OnFailure/Always): a restart in place that restartCount does not show yet.
    restarting: bool = False
    #: The exit of the main container's previous run (``lastState.terminated``): how a
    #: container that was restarted in place ended, read after the kubelet restarted it.
    last_exit_code: int | None = None
    last_exit_reason: str | None = None
    termination_message: str | None = None
    pod_ip: str | None = None
    #: The chief's JSON ``/status`` (fetched by the caller; pods get no API permissions).
    live_status: Mapping[str, Any] | None = None

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> ObservedPod | None:
        """Read a Pod object; ``None`` when it lacks ringtrain's role/index labels."""
        meta = pod.get("metadata") or {}
        lab = meta.get("labels") or {}
        role, index = lab.get(manifests.LABEL_ROLE), lab.get(manifests.LABEL_INDEX)
        if not role or not str(index).isdigit():
            return None
        st = pod.get("status") or {}
        cstats = st.get("containerStatuses") or []
        main = next(
            (c for c in cstats if c.get("name") == manifests.MAIN_CONTAINER),
            cstats[0] if cstats else {},
        )
        state = main.get("state") or {}
        term = state.get("terminated") or {}
        last = (main.get("lastState") or {}).get("terminated") or {}
        policy = (pod.get("spec") or {}).get("restartPolicy")
        phase = st.get("phase") or "Pending"
        restarting = phase in ("Pending", "Running") and (
            (
                bool(term)
                and (policy == "Always" or (policy == "OnFailure" and term.get("exitCode") != 0))
            )
            or (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
        )
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in st.get("conditions") or []
        )
        return cls(
            name=meta.get("name", ""),
            role=role,
            index=int(str(index)),
            phase=phase,
            ready=ready,
            restarts=sum(int(c.get("restartCount") or 0) for c in cstats),
            exit_code=term.get("exitCode"),
            exit_reason=term.get("reason") or st.get("reason"),
            deleting=bool(meta.get("deletionTimestamp")),
            restarting=restarting,
            last_exit_code=last.get("exitCode"),
            last_exit_reason=last.get("reason"),
            termination_message=term.get("message"),
            pod_ip=st.get("podIP"),
        )


def observe_pods(
    job: Job | None, objs: Iterable[Mapping[str, Any]], fetch: LiveStatusFetcher
) -> list[ObservedPod]:
    """The job's Pod objects as ObservedPods (unlabelled ones skipped), the running chief's
    ``/status`` attached when the job runs ringtrain's trainer (``job`` None: spec invalid)."""
    observed = [o for p in objs if (o := ObservedPod.from_pod(p)) is not None]
    if job is None:
        return observed
    return [with_live_status(job, p, fetch) for p in observed]


#: The evaluator whose evaluations the job's status shows (the built-in trainer has one).
EVALUATOR = ("evaluator", 0)


def with_live_status(job: Job, p: ObservedPod, fetch: LiveStatusFetcher) -> ObservedPod:
    """Progress comes from the chief's (and the evaluator's) own HTTP endpoint while it runs
    (no API rights needed)."""
    if (
        (p.role, p.index) not in (job.chief, EVALUATOR)
        or p.phase != "Running"
        or not p.pod_ip
        or not job.trainer
    ):
        return p
    return dataclasses.replace(p, live_status=fetch(p.pod_ip))


def fetch_live_status(pod_ip: str, timeout_s: float = 1.0) -> Mapping[str, Any] | None:
    """The chief's JSON ``/status``; None when it does not answer (yet)."""
    st = events.fetch_status(f"http://{pod_ip}:{manifests.METRICS_PORT}/status", timeout_s)
    return None if st is None else st.to_dict()


#: trainer JSON key (a field of ringtrain.events.Status or .Final) → status.progress key
_PROGRESS_KEYS = {
    "step": "step",
    "steps": "step",
    "epoch": "epoch",
    "loss": "loss",
    "samples_per_s": "samplesPerSecond",
    "test_accuracy": "testAccuracy",
    "checkpoint": "checkpoint",
    "export": "export",
    "trace": "trace",
}
#: the evaluator's JSON key → status.evaluation key
_EVALUATION_KEYS = {
    "step": "step",
    "steps": "step",
    "test_loss": "testLoss",
    "test_accuracy": "testAccuracy",
    "checkpoint": "checkpoint",
    "evaluations": "evaluations",
}
_STRINGS = ("checkpoint", "export", "trace")


_PROGRESS = MappingProxyType(_PROGRESS_KEYS)


def read_progress(doc: Mapping[str, Any] | None, keys: Mapping[str, str] = _PROGRESS) -> dict:
    """The chief's ``/status`` (:class:`ringtrain.events.Status`) or final termination-log JSON
    (:class:`ringtrain.events.Final`) → status.progress fields (``keys``: another table)."""
    out: dict[str, Any] = {}
    for key, target in keys.items():
        v = (doc or {}).get(key)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            continue  # NaN/inf are not JSON and the API would reject the status
        if isinstance(v, (int, float)):
            out[target] = round(v, 6) if isinstance(v, float) else v
        elif isinstance(v, str) and target in _STRINGS:
            out[target] = v
    waiting = (doc or {}).get("waiting_for")
    if isinstance(waiting, list) and waiting:
        out["waitingFor"] = [str(w) for w in waiting]
    if keys is _PROGRESS and (memory := ipu_memory((doc or {}).get("ipu_memory"))):
        out["ipuMemory"] = memory
    return out


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w.title() for w in rest)


def ipu_memory(doc: Any) -> dict:
    """``/status``'s ``ipu_memory`` → ``status.progress.ipuMemory``: per IPU, bytes by kind
    (``weightsBytes`` … ``optimizerStateBytes``), ``totalBytes``, ``capacityBytes`` and
    ``hostOptimizerStateBytes``. The per-layer table stays in ``/status`` and ``--report``:
    the status is an API object, kept small. {} when ``doc`` is not a memory report."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("kinds"), Mapping):
        return {}
    host = doc.get("host")
    host = host if isinstance(host, Mapping) else {}
    pairs = [
        ("capacity", doc.get("capacity")),
        ("total", doc.get("total")),
        *doc["kinds"].items(),
        *((f"host_{k}", v) for k, v in host.items()),
    ]
    return {
        f"{_camel(str(k))}Bytes": v
        for k, v in pairs
        if isinstance(v, int) and not isinstance(v, bool)
    }


def _last_word(p: ObservedPod) -> Mapping[str, Any] | None:
    """A pod's final termination message once it has one (written as the process exits), else
    its live ``/status``."""
    if p.termination_message:
        try:
            final = json.loads(p.termination_message)
        except ValueError:
            final = None
        if isinstance(final, dict):
            return final
    return p.live_status


def chief_progress(job: Job, pods: Iterable[ObservedPod]) -> dict:
    """status.progress fields from the chief."""
    chief = next((p for p in pods if (p.role, p.index) == job.chief), None)
    return {} if chief is None else read_progress(_last_word(chief))


def evaluation(job: Job, pods: Iterable[ObservedPod]) -> dict:
    """status.evaluation from the evaluator: its last evaluated checkpoint's step, loss and
    accuracy ({} before its first evaluation)."""
    ev = next((p for p in pods if (p.role, p.index) == EVALUATOR), None)
    out = {} if ev is None else read_progress(_last_word(ev), _EVALUATION_KEYS)
    return out if "testAccuracy" in out else {}
