"""List + watch caches for the operator's namespaces: every job's pods, and the TrainingJobs.

Per-job pod lists cost the API server a scan of the namespace's pods for every reconcile: with
1,000 jobs of 2 pods, 2,000 pods per list, growing with every job (issue 22). :class:`PodInformer`
lists the pods that carry :data:`manifests.LABEL_JOB` once (in pages), then follows one watch,
and keeps each pod as the :class:`ObservedPod` the fold reads (a few hundred bytes, not the Pod
object), indexed by (namespace, job). A pod event wakes its job only when what the fold reads of
the pod changed: a scheduler's ``PodScheduled`` condition wakes nobody.

:class:`JobInformer` does the same for TrainingJobs, keeping only (uid, generation) per job: a
new job, one found at start-up and a new spec (generation) wake it; the status the operator
writes itself (same generation) wakes nobody and costs one JSON parse — it used to cost kopf's
whole per-event pipeline and a kopf memory per job (issue 22).

A cache may lag the API server by the watch's delay, never more; the reconciler is built for
that (creates are idempotent by the pods' fixed names, a replacement recorded in the status is
finished and never counted twice, the job itself is read fresh). It must never be *empty* when
the cluster is not: reconciles wait for :meth:`ListWatch.synced`, the end of the first full list.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .kube import Kube, body
from .manifests import LABEL_JOB
from .observe import ObservedPod

log = logging.getLogger(__name__)

#: (namespace, job name)
JobKey = tuple[str, str]
#: Objects per page of the (re)list: bounds the memory of one answer whatever the cluster holds.
PAGE = 500
#: Seconds one watch request lasts before it is renewed from the last resourceVersion.
WATCH_S = 300
#: Seconds between tries after a failed list or watch.
RETRY_S = 1.0
#: Bytes of job objects :class:`JobInformer` keeps as raw JSON (without ``managedFields``) so
#: that a reconcile needs no GET: the most recently seen, read or written first. A bound on
#: memory whatever the number of jobs and their size (a 2-worker job is ~1.3 KB, one with an
#: inline Keras config up to 128 KB): 8 MiB holds a burst of several thousand small new jobs.
RECENT_BYTES = 8 << 20


class ListWatch:
    """One list + watch per namespace (None: all namespaces) on daemon threads, kept in a
    cache by :meth:`apply` (watch events) and :meth:`_replace` (a full list); subclasses say
    what they request (:meth:`_request`) and what they keep."""

    what = "objects"

    def __init__(self, kube: Kube, namespaces: list[str] | None) -> None:
        self.kube = kube
        self.namespaces: list[str | None] = list(namespaces) if namespaces else [None]
        self._lock = threading.Lock()
        self._synced = {ns: threading.Event() for ns in self.namespaces}
        self._stop = threading.Event()
        self.events = 0  # watch events read: the benchmark's count

    def synced(self) -> bool:
        return all(e.is_set() for e in self._synced.values())

    def wait_synced(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in self._synced.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.wait(left):
                return False
        return True

    def start(self) -> None:
        for ns in self.namespaces:
            name = f"{self.what}:{ns}"
            threading.Thread(target=self._run, args=(ns,), name=name, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    # -- what a subclass says ------------------------------------------------------------------

    def _request(self, namespace: str | None, **kw: Any) -> Any:
        raise NotImplementedError

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) into the cache."""
        raise NotImplementedError

    def _read(self, namespace: str | None, items: list[dict], into: dict) -> None:
        """A page of a full list into ``into`` (what :meth:`_replace` gets)."""
        raise NotImplementedError

    def _replace(self, namespace: str | None, listed: dict) -> None:
        raise NotImplementedError

    # -- keeping it current --------------------------------------------------------------------

    def _list(self, namespace: str | None) -> str:
        listed: dict = {}
        cont: str | None = None
        while True:
            kw: dict[str, Any] = {"limit": PAGE}
            if cont:
                kw["_continue"] = cont
            page = json.loads(body(self._request(namespace, **kw)))
            self._read(namespace, page.get("items") or [], listed)
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                self._replace(namespace, listed)
                return str(page["metadata"]["resourceVersion"])

    def _run(self, namespace: str | None) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list(namespace)
                    self._synced[namespace].set()
                rv = self._watch(namespace, rv)
            except Exception as e:  # noqa: BLE001 (a dropped connection, an API server restart)
                gone = isinstance(e, ApiException) and e.status == 410
                if not gone:
                    where = namespace or "all namespaces"
                    log.warning("%s watch of %s: %s; retrying", self.what, where, e)
                    time.sleep(RETRY_S)
                rv = None

    def _watch(self, namespace: str | None, rv: str) -> str:
        """Follow the watch from ``rv``; returns the last resourceVersion seen (the request's
        time ran out); raises ApiException(410) when ``rv`` is too old: list again."""
        resp = self._request(
            namespace,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_S,
            _request_timeout=(10, WATCH_S + 30),  # a silently dead connection is noticed
        )
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line or line.isspace():
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.events += 1
                    self.apply(kind, obj)
        finally:
            resp.close()
            resp.release_conn()
        return rv


class PodInformer(ListWatch):
    """The pods of the jobs in ``namespaces``; ``on_change(key)`` is called from the watch
    threads for every job whose pods changed in what the fold reads."""

    what = "pods"

    def __init__(
        self, kube: Kube, namespaces: list[str] | None, on_change: Callable[[JobKey], None]
    ) -> None:
        super().__init__(kube, namespaces)
        self.on_change = on_change
        self._pods: dict[JobKey, dict[str, ObservedPod]] = {}

    def pods(self, namespace: str, job: str) -> list[ObservedPod]:
        """The job's pods, by name (as a list from the API server comes)."""
        with self._lock:
            mine = self._pods.get((namespace, job), {})
            return [mine[n] for n in sorted(mine)]

    def _request(self, namespace: str | None, **kw: Any) -> Any:
        return self.kube.pods_request(namespace, label_selector=LABEL_JOB, **kw)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """Wakes the job if the fold would see a difference."""
        meta = obj.get("metadata") or {}
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        if not job:
            return
        key, name = (meta.get("namespace", ""), job), meta.get("name", "")
        new = None if kind == "DELETED" else ObservedPod.from_pod(obj)
        with self._lock:
            mine = self._pods.setdefault(key, {})
            old = mine.pop(name, None) if new is None else mine.get(name)
            if new is not None:
                mine[name] = new
            elif not mine:
                del self._pods[key]
        if old != new:
            self.on_change(key)

    def _read(self, namespace: str | None, items: list[dict], into: dict) -> None:
        for pod in items:
            meta = pod.get("metadata") or {}
            obs = ObservedPod.from_pod(pod)
            if obs is not None:
                key = (meta.get("namespace") or namespace or "", meta["labels"][LABEL_JOB])
                into.setdefault(key, {})[obs.name] = obs

    def _replace(self, namespace: str | None, listed: dict) -> None:
        """A full list replaces what the cache held of ``namespace``; changed jobs wake."""
        with self._lock:
            before = {k: v for k, v in self._pods.items() if namespace in (None, k[0])}
            for k in before:
                del self._pods[k]
            self._pods.update(listed)
        for key in before.keys() | listed.keys():
            if before.get(key) != listed.get(key):
                self.on_change(key)


class JobInformer(ListWatch):
    """The TrainingJobs in ``namespaces`` as (uid, generation); ``on_change(key, gone)`` is
    called from the watch threads for a job that appeared, got a new spec or a new uid
    (deleted and created again), or is gone (``gone`` True)."""

    what = "trainingjobs"

    def __init__(
        self,
        kube: Kube,
        namespaces: list[str] | None,
        on_change: Callable[[JobKey, bool], None],
    ) -> None:
        super().__init__(kube, namespaces)
        self.on_change = on_change
        self._jobs: dict[JobKey, tuple[str, int]] = {}
        #: key → (uid, generation, raw JSON) of the job as the operator last saw, read or
        #: wrote it; ``_recent_bytes`` is the sum of their sizes (bounded: RECENT_BYTES)
        self._recent: OrderedDict[JobKey, tuple[str, int, bytes]] = OrderedDict()
        self._recent_bytes = 0

    def uid(self, key: JobKey) -> str | None:
        return (self._jobs.get(key) or (None, 0))[0]

    # -- the job object without a GET ----------------------------------------------------------
    #
    # What a reconcile last read or wrote of a job is kept (the status patch's answer is the
    # whole job as written; one reconcile of a job at a time, so the entry is always the
    # operator's latest). The status has no other writer, and a new spec, a new uid or a
    # deletion changes the uid or generation the watch reports: the next reconcile uses the
    # entry only while the watch's (uid, generation) is still the entry's, and reads the job
    # from the API otherwise (a new spec whose event has arrived, an entry evicted). A change
    # the watch has not delivered yet wakes the job again when it arrives. So the status a
    # reconcile folds is never older than the operator's last write, as with a GET every time
    # (issue 22: a pending job's second reconcile, when its pods appear, cost a GET).
    #
    # Two more sources need no write of ours to be older than them: the watch's ADDED event (a
    # job just created: its first event, before anything can wake it, so before any write of
    # ours) and the first full list at start-up (before any reconcile of this process). A new
    # job's first reconcile and a restarted operator's look at every job then cost no GET.
    # A later relist is not used: a write of ours may fall between its snapshot and its end.

    def object(self, key: JobKey) -> dict[str, Any] | None:
        """The job as last seen or written, if it is still the job (uid, generation) the watch
        knows; None: read it from the API."""
        with self._lock:
            entry, current = self._recent.get(key), self._jobs.get(key)
        if entry is None or current is None or entry[:2] != current:
            return None
        return json.loads(entry[2])

    def remember(self, key: JobKey, raw: bytes) -> None:
        """A job object the operator read or wrote (its raw JSON)."""
        self._keep(key, json.loads(raw), raw)

    def _keep(self, key: JobKey, obj: dict[str, Any], raw: bytes | None = None) -> None:
        """Keep ``obj`` as the job's latest (``raw``: its JSON, re-encoded without
        ``managedFields``, which no reconcile reads and which doubles a small job's size)."""
        meta = obj.get("metadata") or {}
        if raw is None or "managedFields" in meta:
            obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
            raw = json.dumps(obj, separators=(",", ":")).encode()
        uid, generation = self._record(obj)[1]
        with self._lock:
            if (old := self._recent.pop(key, None)) is not None:
                self._recent_bytes -= len(old[2])
            self._recent[key] = (uid, generation, raw)
            self._recent_bytes += len(raw)
            while self._recent_bytes > RECENT_BYTES and len(self._recent) > 1:
                self._recent_bytes -= len(self._recent.popitem(last=False)[1][2])

    def drop(self, key: JobKey) -> None:
        """The job sleeps until an event wakes it: its object is read again then."""
        with self._lock:
            self._drop(key)

    def _drop(self, key: JobKey) -> None:
        if (old := self._recent.pop(key, None)) is not None:
            self._recent_bytes -= len(old[2])

    def _request(self, namespace: str | None, **kw: Any) -> Any:
        return self.kube.jobs_request(namespace, **kw)

    @staticmethod
    def _record(obj: dict[str, Any]) -> tuple[JobKey, tuple[str, int]]:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        return key, (str(meta.get("uid", "")), int(meta.get("generation") or 1))

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        key, new = self._record(obj)
        with self._lock:
            old = self._jobs.pop(key, None) if kind == "DELETED" else self._jobs.get(key)
            if kind != "DELETED":
                self._jobs[key] = new
            else:
                self._drop(key)
            fresh = kind == "ADDED" and (self._recent.get(key) or ("",))[0] != new[0]
        if fresh:  # a new job: its first reconcile needs no GET
            self._keep(key, obj)
        if kind == "DELETED":
            self.on_change(key, True)
        elif old != new:
            self.on_change(key, False)

    def _read(self, namespace: str | None, items: list[dict], into: dict) -> None:
        first = not self._synced[namespace].is_set()
        for obj in items:
            key, rec = self._record(obj)
            into[key] = rec
            if first and self._recent_bytes < RECENT_BYTES:  # start-up: no write of ours yet
                self._keep(key, obj)

    def _replace(self, namespace: str | None, listed: dict) -> None:
        """A full list replaces what the cache held of ``namespace``: jobs gone while the watch
        was down are forgotten, new or changed ones wake."""
        with self._lock:
            before = {k: v for k, v in self._jobs.items() if namespace in (None, k[0])}
            for k in before:
                del self._jobs[k]
            self._jobs.update(listed)
        for key in before.keys() - listed.keys():
            with self._lock:
                self._drop(key)
            self.on_change(key, True)
        for key, rec in listed.items():
            if before.get(key) != rec:
                self.on_change(key, False)
