"""What the operator sees of a job: its Pods as :class:`ObservedPod`, the chief's progress and
the evaluator's last evaluation.

Parsing Pod objects lives here, next to the only I/O the observation needs (the chief's
``/status``), so the fold in :mod:`.status` reads plain values and never a Kubernetes object.

That I/O talks to a process the tenant wrote (it chooses the image), so it is bounded and kept
off every other job's reconcile (issue 20): each read has a total deadline and a byte cap
(:func:`fetch_live_status`), runs on :class:`LiveStatusPoller`'s own threads, and a reconcile
waits for it at most :data:`LIVE_STATUS_WAIT_S`, reading the last answer otherwise. A reply that
is no status document is that job's problem: a warning naming the job and the pod, no progress.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ringtrain import events

from . import elastic, manifests, statusbound
from .job import Job

log = logging.getLogger(__name__)

#: pod IP → the chief's ``/status`` as a dict; None when nothing answers (yet);
#: :class:`ringtrain.events.StatusRefused` when what answers is no status document.
LiveStatusFetcher = Callable[[str], "Mapping[str, Any] | None"]


def _intern(value: Any) -> Any:
    """One shared copy of a short repeated string: the pod informer keeps an ObservedPod per pod,
    and each watch event parses role, phase, limit and reason anew (issue 22, memory per job)."""
    return sys.intern(value) if isinstance(value, str) and len(value) <= 64 else value


@dataclass(frozen=True, slots=True)
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
    #: the previous run's message (``lastState.terminated.message``): a permanent exit first
    #: seen after the kubelet restarted the container still says why
    last_termination_message: str | None = None
    pod_ip: str | None = None
    #: The main container's ``resources.limits.memory`` (``1374Mi``): what an OOMKilled exit
    #: names (:func:`.restarts.describe_exit`).
    memory_limit: str | None = None
    #: The chief's JSON ``/status`` (fetched by the caller; pods get no API permissions).
    live_status: Mapping[str, Any] | None = None
    #: The uid of the pod's controller (``manifests.controller_uid``): a pod is the job's only
    #: if it is the job's uid, whatever its name and labels say (issue 35).
    owner: str | None = None
    #: an elastic job's worker: the size document its annotation holds (``elastic.ANNOTATION``)
    elastic: str | None = None

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
        spec_main: Mapping[str, Any] = next(
            (
                c
                for c in (pod.get("spec") or {}).get("containers") or []
                if c.get("name") == main.get("name", manifests.MAIN_CONTAINER)
            ),
            {},
        )
        limit = ((spec_main.get("resources") or {}).get("limits") or {}).get("memory")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in st.get("conditions") or []
        )
        return cls(
            name=meta.get("name", ""),
            role=_intern(role),
            index=int(str(index)),
            phase=_intern(phase),
            ready=ready,
            restarts=sum(int(c.get("restartCount") or 0) for c in cstats),
            exit_code=term.get("exitCode"),
            exit_reason=_intern(term.get("reason") or st.get("reason")),
            deleting=bool(meta.get("deletionTimestamp")),
            restarting=restarting,
            last_exit_code=last.get("exitCode"),
            last_exit_reason=_intern(last.get("reason")),
            termination_message=term.get("message"),
            last_termination_message=last.get("message"),
            pod_ip=st.get("podIP"),
            memory_limit=_intern(str(limit)[:64]) if limit is not None else None,
            owner=_intern(manifests.controller_uid(pod)),
            elastic=(meta.get("annotations") or {}).get(elastic.ANNOTATION),
        )


def observe_pods(
    job: Job | None,
    objs: Iterable[Mapping[str, Any] | ObservedPod],
    fetch: LiveStatusFetcher,
    owner: str | None = None,
) -> list[ObservedPod]:
    """The job's Pod objects (or the informer's ObservedPods) as ObservedPods (unlabelled ones
    skipped), the running chief's ``/status`` attached when the job runs ringtrain's trainer
    (``job`` None: spec invalid). With ``owner`` (the job's uid) only the pods it controls: a
    pod planted under the job's names and labels is not the job's (nor asked its status)."""
    observed = [
        o
        for p in objs
        if (o := p if isinstance(p, ObservedPod) else ObservedPod.from_pod(p)) is not None
        and (owner is None or o.owner == owner)
    ]
    if job is None:
        return observed
    return [with_live_status(job, p, fetch) for p in observed]


#: The evaluator whose evaluations the job's status shows (the built-in trainer has one).
EVALUATOR = ("evaluator", 0)


def with_live_status(job: Job, p: ObservedPod, fetch: LiveStatusFetcher) -> ObservedPod:
    """Progress comes from the chief's (and the evaluator's) own HTTP endpoint while it runs
    (no API rights needed). A reply that is no status is logged, naming the job and the pod."""
    if (
        (p.role, p.index) not in (job.chief, EVALUATOR)
        or p.phase != "Running"
        or not p.pod_ip
        or not job.trainer
    ):
        return p
    try:
        live = fetch(p.pod_ip)
    except events.StatusRefused as e:
        log.warning("%s/%s: %s's /status refused: %s", job.namespace, job.name, p.name, e)
        live = None
    return dataclasses.replace(p, live_status=live)


#: Seconds one ``/status`` read may take in all (connect, ask, every byte of the reply).
LIVE_STATUS_TIMEOUT_S = 2.0
#: Seconds a reconcile waits for a fresh ``/status`` (a healthy chief answers in milliseconds)
#: before it reads the last answer: a chief that drips its reply delays its own job's reconcile
#: this much, and no other job's.
LIVE_STATUS_WAIT_S = 0.25
#: Threads reading ``/status`` replies, apart from the reconcile threads: each holds at most one
#: reply of :data:`ringtrain.events.STATUS_MAX_BYTES` (and its parse, ≤ ~17 MiB for 1 MiB of
#: ``[{},{},…]``), so the operator's memory for them stays bounded whatever tenants send; while
#: fewer tenants than this have a dripping chief, a healthy chief's progress stays fresh.
LIVE_STATUS_THREADS = 8
#: Seconds the last answer of a pod IP may stand in for a read still running: a pod IP is
#: reused by other pods, so an old answer must not outlive its pod by long.
LIVE_STATUS_STALE_S = 30.0


def fetch_live_status(
    pod_ip: str, timeout_s: float = LIVE_STATUS_TIMEOUT_S, port: int | None = None
) -> Mapping[str, Any] | None:
    """The chief's JSON ``/status``; None when it does not answer (yet); StatusRefused when the
    reply is no status document. Bounded: ``timeout_s`` in all and
    :data:`ringtrain.events.STATUS_MAX_BYTES` (:func:`ringtrain.events.read_status`)."""
    url = f"http://{pod_ip}:{port or manifests.METRICS_PORT}/status"
    try:
        return events.read_status(url, timeout_s).to_dict()
    except OSError:
        return None


class LiveStatusPoller:
    """A :data:`LiveStatusFetcher` that reads on its own threads, one read per pod IP in flight:
    the caller gets the read it started if it ends within ``wait_s``, else the last read that
    ended (None before the first). A refusal is raised once, by the call that sees it end, so it
    is logged once per read and not at every reconcile that reads the stale answer."""

    def __init__(
        self,
        fetch: LiveStatusFetcher = fetch_live_status,
        *,
        wait_s: float = LIVE_STATUS_WAIT_S,
        threads: int = LIVE_STATUS_THREADS,
        remember: int = 4096,
    ) -> None:
        self._fetch, self._wait_s, self._threads, self._remember = fetch, wait_s, threads, remember
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}
        #: pod IP → (when its last read ended, what it gave)
        self._last: OrderedDict[str, tuple[float, Mapping[str, Any] | None]] = OrderedDict()

    def _stale(self, pod_ip: str) -> Mapping[str, Any] | None:
        when, result = self._last.get(pod_ip, (0.0, None))
        return result if time.monotonic() - when <= LIVE_STATUS_STALE_S else None

    def __call__(self, pod_ip: str) -> Mapping[str, Any] | None:
        with self._lock:
            fut = self._inflight.get(pod_ip)
            if fut is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, "live-status")
                fut = self._inflight[pod_ip] = self._pool.submit(self._fetch, pod_ip)
        try:
            result = fut.result(timeout=self._wait_s)
        except FutureTimeout:
            with self._lock:
                return self._stale(pod_ip)
        except events.StatusRefused:
            result, refused = None, True
        else:
            refused = False
        with self._lock:
            if self._inflight.get(pod_ip) is not fut:
                return self._stale(pod_ip)  # another caller took this read's end
            del self._inflight[pod_ip]
            self._last[pod_ip] = (time.monotonic(), result)
            self._last.move_to_end(pod_ip)
            while len(self._last) > self._remember:
                self._last.popitem(last=False)
        if refused:
            fut.result()  # raises the refusal, once
        return result


#: The operator's poller (its threads start with the first read).
live_status = LiveStatusPoller()


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
    "ring_size": "ringSize",
    "resize_step": "resizeStep",
    "resize_s": "resizeSeconds",
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
    (:class:`ringtrain.events.Final`) → status.progress fields (``keys``: another table), each
    bounded by :mod:`.statusbound`: what the API would refuse (NaN, 10⁴⁰) is left out, what is
    too large for an etcd object is left out or shortened and named in ``truncated``."""
    doc = doc or {}
    out: dict[str, Any] = {}
    cut: list[str] = []
    for key, target in keys.items():
        v = doc.get(key)
        if (n := statusbound.number(v)) is not None:
            out[target] = n
        elif isinstance(v, str) and target in _STRINGS:
            if (s := statusbound.text(v)) is None:
                cut.append(target)
            else:
                out[target] = s
    names, shortened = statusbound.names(doc.get("waiting_for"))
    if names:
        out["waitingFor"] = names
    cut += ["waitingFor"] if shortened else []
    if keys is _PROGRESS:
        memory, shortened = statusbound.ipu_memory(doc.get("ipu_memory"))
        if memory:
            out["ipuMemory"] = memory
        cut += ["ipuMemory"] if shortened else []
    if cut:
        out[statusbound.TRUNCATED] = cut
    return out


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


def progress_of(reporter: ObservedPod | None) -> dict:
    """status.progress fields from the job's reporter (``kinds.Kind.reporter``: the chief, or an
    MPI job's launcher once it has its final result)."""
    return {} if reporter is None else read_progress(_last_word(reporter))


def evaluation(job: Job, pods: Iterable[ObservedPod]) -> dict:
    """status.evaluation from the evaluator: its last evaluated checkpoint's step, loss and
    accuracy ({} before its first evaluation)."""
    ev = next((p for p in pods if (p.role, p.index) == EVALUATOR), None)
    out = {} if ev is None else read_progress(_last_word(ev), _EVALUATION_KEYS)
    return out if "testAccuracy" in out else {}
