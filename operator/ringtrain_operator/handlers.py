"""kopf handlers: thin wiring from cluster events to :func:`reconcile.reconcile`.

One async daemon per TrainingJob owns that job: every reconcile of a job runs in its daemon, one
at a time, so two decisions about the same job can never race. Pod and spec changes only *poke*
the daemon; deadlines, TTL and progress polling are the daemon's timeout. After a restart kopf
resumes a daemon for every existing job, which then reconciles from cluster state.

Each handler only wires: the decisions are :mod:`.status`'s, the API calls :mod:`.reconcile`'s,
when to look again :func:`status.look_again_s`, and every Event goes out through :func:`post`.
kopf's settings are made in one place, :func:`.main.operator_settings`.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
from kubernetes.client import ApiException

from . import manifests, networkpolicy, status
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


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def run_job(
    name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_
) -> None:
    poke = memo.pokes.setdefault((namespace, name), asyncio.Event())
    while not stopped:
        poke.clear()
        decision = await asyncio.to_thread(reconcile_once, memo, namespace, name)
        if decision is None or decision.delete_job:
            return
        post(body, decision.events)
        await _wait(poke, stopped, status.look_again_s(decision))


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
    except Exception as e:  # a bug must not take the job's daemon (or the operator) down
        log.exception("%s/%s: reconcile crashed", namespace, name)
        why, failed = f"{type(e).__name__}", "crashed"
    n = memo.failures[key] = memo.failures.get(key, 0) + 1
    delay = status.error_retry_s(n)
    message = f"reconcile {failed} ({n} in a row), retrying in {delay:g}s: {why}"
    log.warning("%s/%s: %s", namespace, name, message)
    warning = status.Event("Warning", status.REASON_RECONCILE_FAILED, message)
    events = (warning,) if status.warn_again(n) else ()
    return status.Decision(status={}, events=events, requeue_after_s=delay)


def post(body: kopf.Body, events: tuple[status.Event, ...]) -> None:
    """The one place Events about a TrainingJob are posted."""
    for ev in events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def forget_job(name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    memo.pokes.pop((namespace, name), None)
    memo.failures.pop((namespace, name), None)
    memo.metrics.forget(namespace, name)


@kopf.on.event("", "v1", "pods", labels={manifests.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_) -> None:
    if poke := memo.pokes.get((namespace, labels[manifests.LABEL_JOB])):
        poke.set()


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    if poke := memo.pokes.get((namespace, name)):
        poke.set()


async def _wait(poke: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float | None) -> None:
    tasks = {asyncio.ensure_future(poke.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def new_memo(
    kube: Kube, metrics: OperatorMetrics, network: networkpolicy.Settings | None = None
) -> kopf.Memo:
    return kopf.Memo(kube=kube, metrics=metrics, pokes={}, network=network, failures={})
