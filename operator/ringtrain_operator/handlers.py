"""kopf handlers: thin wiring from cluster events to :func:`reconcile.reconcile`.

kopf runs the operator (log-in, start-up, clean-up, its own warnings as Events);
:class:`.informer.JobInformer` watches the TrainingJobs and :class:`.informer.PodInformer` their
pods (one watch each for the namespace set); both only *queue* a job's key on
:class:`.controller.Controller`'s work queue, whose bounded pool of workers reconciles each job,
one reconcile of a job at a time, so two decisions about the same job can never race. Deadlines,
TTL, progress polling and failure backoff are the job's timer on that queue. After a restart the
job informer lists every existing job, each is queued and reconciles from cluster state once
both informers have listed. kopf no longer watches TrainingJobs: its per-event pipeline (a
worker, a memory and a handler call per event, our own status writes included) was a quarter of
the operator's CPU at 1,000 jobs and a kopf memory per job (issue 22).

Each handler only wires: the decisions are :mod:`.status`'s, the API calls :mod:`.reconcile`'s,
when to look again :func:`status.look_again_s`, and every Event goes out through
:func:`.posting.post`. kopf's settings are made in one place, :func:`.main.operator_settings`.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
from kubernetes.client import ApiException

from . import networkpolicy, posting, spec, status
from .controller import Controller
from .informer import JobInformer, PodInformer
from .kube import Kube
from .metrics import OperatorMetrics
from .reconcile import forget_spec, reconcile

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


@kopf.on.startup()
async def startup(memo: kopf.Memo, **_) -> None:
    start(memo)


def start(memo: kopf.Memo) -> Controller:
    """The workers and both informers, started once, on kopf's loop. The job informer wakes a
    job that appears (or is found after a restart) or gets a new spec; our own status writes
    (same generation) wake nothing. A pod of a job not (or no longer) known wakes nothing."""
    ctl: Controller = memo.controller
    if ctl.started:
        return ctl
    spec.warm()  # the CRD's schema and validator, built before the first job waits on them
    ctl.start()
    loop = asyncio.get_running_loop()

    def job_changed(key: tuple[str, str], gone: bool) -> None:
        if gone:
            loop.call_soon_threadsafe(forget, memo, key)
        else:
            ctl.add_threadsafe(key)

    def pod_changed(key: tuple[str, str]) -> None:
        if jobs.uid(key):
            ctl.add_threadsafe(key)

    jobs = ctl.jobs = JobInformer(memo.kube, memo.namespaces, job_changed)
    ctl.informer = PodInformer(memo.kube, memo.namespaces, pod_changed)
    memo.kube.pod_source = ctl.informer.pods
    memo.kube.job_source = jobs
    ctl.informer.start()
    jobs.start()
    return ctl


def forget(memo: kopf.Memo, key: tuple[str, str]) -> None:
    forget_spec(*key)
    memo.controller.queue.forget(key)
    memo.failures.pop(key, None)
    memo.metrics.forget(*key)


def handle(memo: kopf.Memo, key: tuple[str, str]) -> status.Decision | None:
    """One reconcile of a queued job, on a worker thread."""
    return reconcile_once(memo, *key)


def after(memo: kopf.Memo, key: tuple[str, str], decision: status.Decision | None) -> float | None:
    """On the loop, after a reconcile: post its Events, say when to look again."""
    if decision is None or decision.delete_job:
        forget(memo, key)
        return None
    jobs = memo.controller.jobs
    if decision.events and jobs is not None and (uid := jobs.uid(key)):
        posting.post(memo.kube, {"namespace": key[0], "name": key[1], "uid": uid}, decision.events)
    again = status.look_again_s(decision)
    if again is None and not decision.to_create and not decision.delete and jobs is not None:
        jobs.drop(key)  # nothing will look soon: keep no object or spec for a sleeping job
        forget_spec(*key)
    return again


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
    if (jobs := memo.controller.jobs) is not None:
        jobs.drop(key)  # a write may have happened unanswered: read the job again
    n = memo.failures[key] = memo.failures.get(key, 0) + 1
    delay = status.error_retry_s(n)
    message = f"reconcile {failed} ({n} in a row), retrying in {delay:g}s: {why}"
    log.warning("%s/%s: %s", namespace, name, message)
    warning = status.Event("Warning", status.REASON_RECONCILE_FAILED, message)
    events = (warning,) if status.warn_again(n) else ()
    return status.Decision(status={}, events=events, requeue_after_s=delay)


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
    )

    async def ready() -> None:
        while not (ctl.informer and ctl.informer.synced() and ctl.jobs.synced()):
            await asyncio.sleep(0.05)

    ctl = memo.controller = Controller(
        lambda key: handle(memo, key), lambda key, d: after(memo, key, d), ready
    )
    return memo


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_) -> None:
    await memo.controller.stop()
