"""One reconcile of one TrainingJob: observe the cluster, fold, write status, act.

The job is read fresh from the API, never from a cache, so a restarted operator — or one whose
previous status write the watch has not yet delivered — decides from the truth of its status.
Its pods come from the pod informer (:mod:`.informer`; one list call without it), which may lag
by the watch's delay: the status is written *before* the actions, so a pod replacement that is
recorded but not yet seen done (deletion cut short by a crash, or an informer behind) is
finished by the next reconcile, never counted twice, and a create of a pod that exists is a 409.

Only what the job controls is the job's (issue 35): its pods are those whose controller
ownerReference has its uid, whatever their names and labels; a 409 is adopted only for an object
of its own, and someone else's object under its names, or a create the API server refuses for
good, fails the job with a message naming it (:mod:`.verdicts`), instead of a retry loop.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiException

from ringtrain.errors import InvalidSpec

from . import admission, elastic, kinds, lifecycle, manifests, networkpolicy, status, verdicts
from .job import Job
from .kube import Kube
from .metrics import OperatorMetrics
from .observe import LiveStatusFetcher, live_status, observe_pods

#: Pod creations in flight at once, for all jobs: one pool for every reconcile (a pool per gang
#: cost a thread start per pod created).
CREATE_CONCURRENCY = 16
_CREATE_POOL = ThreadPoolExecutor(CREATE_CONCURRENCY, "create-pods")


#: Jobs whose spec was loaded: (namespace, name) → (what it was loaded from, the Job or why it
#: is invalid). A job's next reconciles (its pods appear, a poll) find the same spec and skip
#: the defaulting and schema validation (~0.8 ms, a tenth of a new job's CPU; issue 22); the
#: key is the spec's JSON with the uid and generation (encoding it costs ~30 µs), so nothing
#: depends on the API server bumping the generation. Bounded, and a sleeping job's entry is
#: dropped (:func:`forget_spec`): 10,000 pending jobs keep none.
SPECS = 1024
_specs: OrderedDict[tuple[str, str], tuple[str, Job | str]] = OrderedDict()
_specs_lock = threading.Lock()


def load_spec(obj: Mapping[str, Any]) -> Job:
    """:func:`admission.load` (the spec check), remembered while the job's spec, uid and
    generation stay the same."""
    meta = obj.get("metadata") or {}
    try:
        source = json.dumps(
            [obj.get("apiVersion"), obj.get("kind"), meta.get("uid"), meta.get("generation"),
             obj.get("spec")], separators=(",", ":"))  # fmt: skip
    except (TypeError, ValueError):  # not JSON (a YAML oddity): spec.load says what is wrong
        return admission.load(obj)
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    with _specs_lock:
        entry = _specs.get(key)
    if entry is not None and entry[0] == source:
        known = entry[1]
    else:
        try:
            known = admission.load(obj)
        except InvalidSpec as e:
            known = str(e)  # the message: a kept exception would grow its traceback
        with _specs_lock:
            _specs[key] = (source, known)
            _specs.move_to_end(key)
            while len(_specs) > SPECS:
                _specs.popitem(last=False)
    if isinstance(known, str):
        raise InvalidSpec(known)
    return known


def forget_spec(namespace: str, name: str) -> None:
    with _specs_lock:
        _specs.pop((namespace, name), None)


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict:
    """A JSON merge patch (RFC 7386) turning ``old`` into ``new``: an object is patched key by
    key, so a key gone from a nested object (``elastic.resizing``, ``progress.waitingFor``) is
    removed with null — the API server merges nested objects, and would keep it otherwise."""
    patch: dict[str, Any] = {}
    for k, v in new.items():
        was = old.get(k)
        if isinstance(v, Mapping) and isinstance(was, Mapping):
            if sub := status_patch(was, v):
                patch[k] = sub
        elif was != v or k not in old:
            patch[k] = v
    patch.update({k: None for k in old if k not in new})
    return patch


#: The finalizer an operator before issue 22's kopf bookkeeping put on every job; nothing
#: writes it now, so a job that still carries it could never be deleted.
OLD_FINALIZER = "ringtrain.io/finalizer"


def drop_old_finalizer(kube: Kube, obj: Mapping[str, Any]) -> None:
    meta = obj.get("metadata") or {}
    if OLD_FINALIZER in (finalizers := meta.get("finalizers") or []):
        keep = [f for f in finalizers if f != OLD_FINALIZER]
        kube.patch_job(meta["namespace"], meta["name"], {"metadata": {"finalizers": keep or None}})


def reconcile(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    now: datetime | None = None,
    fetch: LiveStatusFetcher = live_status,
    metrics: OperatorMetrics | None = None,
    network: networkpolicy.Settings | None = None,
) -> status.Decision | None:
    """Bring one job one step closer to its spec; None when the job no longer exists.

    The returned decision's events are all this reconcile's Events: the fold's, then one per
    pod created or deleted."""
    started = time.perf_counter()
    obj = kube.get_job(namespace, name)
    if obj is None:
        return None
    drop_old_finalizer(kube, obj)
    now = now or datetime.now(UTC)
    pod_objs = kube.list_pods(namespace, name)
    previous = obj.get("status") or {}
    owner = (obj.get("metadata") or {}).get("uid") or None  # its pods: those it controls
    job: Job | None
    try:
        running, refused = elastic.running_at(obj)  # an elastic job at its edited count
        loaded = load_spec(running)
        if refused and loaded.elastic is not None:
            loaded = dataclasses.replace(
                loaded, elastic=dataclasses.replace(loaded.elastic, refused=refused)
            )
    except InvalidSpec as e:
        job = None
        generation = int(obj.get("metadata", {}).get("generation") or 1)
        seen = observe_pods(None, pod_objs, fetch, owner)
        decision = lifecycle.derive_invalid(seen, now, previous, str(e), generation)
    else:
        job = loaded
        seen = observe_pods(job, pod_objs, fetch, owner)
        decision = lifecycle.derive_status(job, seen, now, previous)

    if patch := status_patch(previous, decision.status):
        kube.patch_status(namespace, name, patch)
    try:
        decision = act(kube, namespace, name, job, decision, network)
    except verdicts.Refused as e:  # not a retry: a verdict, written as the job's failure
        assert job is not None  # nothing is created for a job without a valid spec
        failed = lifecycle.derive_refused(job, seen, now, decision.status, e.reason, e.message)
        if patch := status_patch(decision.status, failed.status):
            kube.patch_status(namespace, name, patch)
        failed = act(kube, namespace, name, job, failed, network)
        decision = dataclasses.replace(failed, events=(*e.events, *failed.events))
    if metrics is not None:
        metrics.record(namespace, name, decision)
        metrics.reconcile_seconds.observe(time.perf_counter() - started)
    return decision


def act(
    kube: Kube,
    namespace: str,
    name: str,
    job: Job | None,
    decision: status.Decision,
    network: networkpolicy.Settings | None = None,
) -> status.Decision:
    """Carry out a decision whose status is written: the operator's only creates and deletes.
    Returns it with an Event added for every pod actually created or deleted. With ``network``
    (``--network-policy``) the job's NetworkPolicy is created with its Service. Raises
    :class:`verdicts.Refused` (its ``events`` this call's) when an object cannot be the job's."""
    events = list(decision.events)
    if decision.to_create and job is not None:
        # before the pods (a pod is never left without them), together (one round trip);
        # each created once: a 409 keeps the first token and keys (if they are the job's)
        kind = kinds.of(job)
        first = kind.job_objects(job)
        if network is not None:
            first.append(kind.network_policy(job, network))
        _settle(_create_all(kube, first), events)
        todo = [kind.pod(job, m.replica, m.index) for m in decision.to_create]
        results = _create_all(kube, todo)
        for m, created in zip(decision.to_create, results, strict=True):
            if created is True:
                events.append(
                    status.Event("Normal", status.REASON_POD_CREATED, f"created pod {m.name}")
                )
        _settle(results, events)
    for pod_name, size in decision.annotate:  # before the deletes: see ``.resizing``
        kube.annotate_pod(namespace, pod_name, {elastic.ANNOTATION: size})
    for pod_name in decision.delete:
        if kube.delete_pod(namespace, pod_name):
            events.append(
                status.Event("Normal", status.REASON_POD_DELETED, f"deleted pod {pod_name}")
            )
    if decision.delete_job:
        kube.delete_job(namespace, name)
    return dataclasses.replace(decision, events=tuple(events))


def create(kube: Kube, obj: dict) -> bool:
    """Create ``obj``: True if created, False if it was there and is the job's own (a 409 of a
    create repeated after a crash, or of a pod the informer has not shown yet). Raises
    :class:`verdicts.Refused` for someone else's object or a permanent refusal, an
    ``ApiException`` to retry."""
    try:
        if kube.create(obj):
            return True
    except ApiException as e:
        if (refused := verdicts.refusal(obj, e.status, e.reason or "", e.body)) is not None:
            raise refused from None
        raise
    if manifests.controller_uid(obj) is None:  # rendered without a uid: nothing to compare
        return False
    meta = obj["metadata"]
    verdicts.adopt(obj, kube.read(obj["kind"], meta["namespace"], meta["name"]))
    return False


def _create_all(kube: Kube, objs: list[dict]) -> list[bool | Exception]:
    """Create a gang's pods concurrently (a 16-worker job is 16 API round trips, each mostly
    waiting): each one's result, or what it raised, in input order."""
    if len(objs) <= 1:
        return [_outcome(kube, o) for o in objs]
    futures = [_CREATE_POOL.submit(_outcome, kube, o) for o in objs]
    wait(futures)
    return [f.result() for f in futures]


def _outcome(kube: Kube, obj: dict) -> bool | Exception:
    try:
        return create(kube, obj)
    except Exception as e:  # noqa: BLE001 (judged with the others', re-raised: ``_settle``)
        return e


def _settle(results: list[bool | Exception], events: list[status.Event]) -> None:
    """Raise what the creates met: a verdict first (the job fails, with ``events`` so far),
    else the first error (retried)."""
    errors = [r for r in results if isinstance(r, Exception)]
    refused = [r for r in errors if isinstance(r, verdicts.Refused)]
    if refused:
        refused[0].events = tuple(events)
        raise refused[0]
    if errors:
        raise errors[0]
