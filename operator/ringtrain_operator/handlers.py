"""kopf handlers: thin wiring from cluster events to :func:`reconcile.reconcile`.

kopf watches the TrainingJobs; :class:`.informer.PodInformer` watches their pods (one watch for
the namespace set, indexed by job); both only *queue* a job's key on :class:`.controller.
Controller`'s work queue, whose bounded pool of workers reconciles each job, one reconcile of a
job at a time, so two decisions about the same job can never race. Deadlines, TTL, progress
polling and failure backoff are the job's timer on that queue. After a restart kopf lists every
existing job, each is queued and reconciles from cluster state once the pod informer has listed.

Each handler only wires: the decisions are :mod:`.status`'s, the API calls :mod:`.reconcile`'s,
when to look again :func:`status.look_again_s`, and every Event goes out through :func:`post`.
kopf's settings are made in one place, :func:`.main.operator_settings`.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
from kubernetes.client import ApiException

from . import networkpolicy, status
from .controller import Controller
from .informer import PodInformer
from .kube import Kube
from .metrics import OperatorMetrics
from .reconcile import reconcile
from .spec import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)


@kopf.on.login()
def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    """kopf talks to the API with exactly the credentials the operator loaded (``--kubeconfig``
    or in-cluster), not with kopf's own guess from ``$KUBECONFIG`` at import time."""
    return connection_info(memo.kube.api_client.configuration)


def connection_info(cfg) -> kopf.ConnectionInfo:
    """kopf's ConnectionInfo from a ``kubernetes.client.Configuration``."""
    header = (
        cfg.get_api_key_with_prefix("BearerToken")
        or cfg.get_api_key_with_prefix("authorization")
        or ""
    )
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(
    event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_
) -> None:
    """Every TrainingJob event, the listing at start-up included: a new job, a job found after
    a restart, or a changed spec (a new generation) queues the job; our own status writes
    (same generation) do not."""
    key = (namespace, name)
    ctl = start(memo)
    if event.get("type") == "DELETED":
        forget(memo, key)
        return
    meta = body.get("metadata", {})
    generation = meta.get("generation")
    memo.refs[key] = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": name, "namespace": namespace, "uid": meta.get("uid")},
    }
    seen, memo.generations[key] = memo.generations.get(key), generation
    if event.get("type") in (None, "ADDED") or seen != generation:
        ctl.queue.add(key)


def start(memo: kopf.Memo) -> Controller:
    """The pod informer and the workers, started once, from the first job event (the workers
    inherit kopf's Event queue from its context)."""
    ctl: Controller = memo.controller
    if not ctl.started:
        ctl.start()
        if ctl.informer is None:
            refs = memo.refs  # a pod of a job not (or no longer) known wakes nothing

            def wake(key: tuple[str, str]) -> None:
                if key in refs:
                    ctl.add_threadsafe(key)

            ctl.informer = PodInformer(memo.kube, memo.namespaces, wake)
            memo.kube.pod_source = ctl.informer.pods
            ctl.informer.start()
    return ctl


def forget(memo: kopf.Memo, key: tuple[str, str]) -> None:
    memo.controller.queue.forget(key)
    for d in (memo.refs, memo.generations, memo.failures):
        d.pop(key, None)
    memo.metrics.forget(*key)


def handle(memo: kopf.Memo, key: tuple[str, str]) -> status.Decision | None:
    """One reconcile of a queued job, on a worker thread."""
    return reconcile_once(memo, *key)


def after(memo: kopf.Memo, key: tuple[str, str], decision: status.Decision | None) -> float | None:
    """On the loop, after a reconcile: post its Events, say when to look again."""
    if decision is None or decision.delete_job:
        forget(memo, key)
        return None
    if (ref := memo.refs.get(key)) and decision.events:
        post(ref, decision.events)
        memo.metrics.api_requests.labels("POST").inc(len(decision.events))  # kopf posts them
    return status.look_again_s(decision)


def reconcile_once(memo: kopf.Memo, namespace: str, name: str) -> status.Decision | None:
    """One reconcile; a failure becomes a decision to retry, with a Warning Event saying why.
    Failures in a row back off (``status.error_retry_s``) and warn less often: never a loop."""
    key = (namespace, name)
    try:
        decision = reconcile(memo.kube, namespace, name, metrics=memo.metrics, network=memo.network)
        memo.failures.pop(key, None)
        return decision
    except ApiException as e:
        why, failed = f"{e.status} {e.reason}", "failed"
    except Exception as e:  # a bug must not take a worker (or the operator) down
        log.exception("%s/%s: reconcile crashed", namespace, name)
        why, failed = f"{type(e).__name__}", "crashed"
    n = memo.failures[key] = memo.failures.get(key, 0) + 1
    delay = status.error_retry_s(n)
    message = f"reconcile {failed} ({n} in a row), retrying in {delay:g}s: {why}"
    log.warning("%s/%s: %s", namespace, name, message)
    warning = status.Event("Warning", status.REASON_RECONCILE_FAILED, message)
    events = (warning,) if status.warn_again(n) else ()
    return status.Decision(status={}, events=events, requeue_after_s=delay)


def post(body: kopf.Body | dict, events: tuple[status.Event, ...]) -> None:
    """The one place Events about a TrainingJob are posted."""
    for ev in events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)


def new_memo(
    kube: Kube,
    metrics: OperatorMetrics,
    network: networkpolicy.Settings | None = None,
    namespaces: list[str] | None = None,
) -> kopf.Memo:
    """The operator's state, shared by every handler (kopf hands each a shallow copy)."""
    memo = kopf.Memo(
        kube=kube,
        metrics=metrics,
        network=network,
        failures={},
        namespaces=namespaces or None,
        refs={},
        generations={},
    )

    async def ready() -> None:
        while ctl.informer is None or not ctl.informer.synced():
            await asyncio.sleep(0.05)

    ctl = memo.controller = Controller(
        lambda key: handle(memo, key), lambda key, d: after(memo, key, d), ready
    )
    return memo


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_) -> None:
    await memo.controller.stop()
