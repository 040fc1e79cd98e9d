"""One reconcile of one TrainingJob: observe the cluster, fold, write status, act.

Everything is read fresh from the API (the job and its pods), never from a cache, so a restarted
operator — or one whose previous status write the watch has not yet delivered — decides from the
truth. The status is written *before* the actions: a gang restart that is recorded but whose
deletions were cut short by a crash is finished by the next reconcile, never counted twice.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from ringtrain import events
from ringtrain.errors import InvalidSpec

from . import manifests, spec, status
from .kube import Kube
from .metrics import OperatorMetrics

#: Pod creations in flight at once for one job.
CREATE_CONCURRENCY = 8

LiveStatusFetcher = Callable[[str], "Mapping[str, Any] | None"]


def fetch_live_status(pod_ip: str, timeout_s: float = 1.0) -> Mapping[str, Any] | None:
    """The chief's JSON ``/status``; None when it does not answer (yet)."""
    st = events.fetch_status(f"http://{pod_ip}:{manifests.METRICS_PORT}/status", timeout_s)
    return None if st is None else st.to_dict()


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict:
    """A JSON merge patch turning ``old`` into ``new`` at the top level (None deletes a key)."""
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


def reconcile(kube: Kube, namespace: str, name: str, *, now: datetime | None = None,
              fetch: LiveStatusFetcher = fetch_live_status,
              metrics: OperatorMetrics | None = None) -> status.Decision | None:
    """Bring one job one step closer to its spec; None when the job no longer exists."""
    started = time.perf_counter()
    obj = kube.get_job(namespace, name)
    if obj is None:
        return None
    now = now or datetime.now(timezone.utc)
    observed = [o for p in kube.list_pods(namespace, name)
                if (o := status.ObservedPod.from_pod(p)) is not None]
    previous = obj.get("status") or {}
    try:
        job = spec.load(obj)
    except InvalidSpec as e:
        generation = int(obj.get("metadata", {}).get("generation") or 1)
        decision = status.derive_invalid(observed, now, previous, str(e), generation)
        job = None
    else:
        observed = [_with_live_status(job, p, fetch) for p in observed]
        decision = status.derive_status(job, observed, now, previous)

    if patch := status_patch(previous, decision.status):
        kube.patch_status(namespace, name, patch)
    events = list(decision.events)
    if decision.create and job is not None:
        kube.create(manifests.service(job))
        kube.create(manifests.secret(job))  # 409 keeps the first token: created once
        todo = [p for p in manifests.pods(job) if p["metadata"]["name"] in decision.create]
        for pod, created in zip(todo, _create_all(kube, todo)):
            if created:
                events.append(status.Event("Normal", "PodCreated",
                                           f"created pod {pod['metadata']['name']}"))
    for pod_name in decision.delete:
        if kube.delete_pod(namespace, pod_name):
            events.append(status.Event("Normal", "PodDeleted", f"deleted pod {pod_name}"))
    if decision.delete_job:
        kube.delete_job(namespace, name)
    decision = dataclasses.replace(decision, events=tuple(events))
    if metrics is not None:
        metrics.record(namespace, name, decision)
        metrics.reconcile_seconds.observe(time.perf_counter() - started)
    return decision


def _create_all(kube: Kube, objs: list[dict]) -> list[bool]:
    """Create a gang's pods concurrently (a 16-worker job is 16 API round trips, each mostly
    waiting): results in input order; the first error is raised after all calls finished."""
    if len(objs) <= 1:
        return [kube.create(o) for o in objs]
    with ThreadPoolExecutor(max_workers=min(CREATE_CONCURRENCY, len(objs))) as ex:
        futures = [ex.submit(kube.create, o) for o in objs]
    return [f.result() for f in futures]


def _with_live_status(job: spec.Job, p: status.ObservedPod,
                      fetch: LiveStatusFetcher) -> status.ObservedPod:
    """Progress comes from the chief's own HTTP endpoint while it runs (no API rights needed)."""
    if (p.role, p.index) != job.chief or p.phase != "Running" or not p.pod_ip or not job.trainer:
        return p
    return dataclasses.replace(p, live_status=fetch(p.pod_ip))
