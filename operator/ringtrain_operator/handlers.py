"""kopf handlers: thin wiring from cluster events to :func:`reconcile.reconcile`.

One async daemon per TrainingJob owns that job: every reconcile of a job runs in its daemon, one
at a time, so two decisions about the same job can never race. Pod and spec changes only *poke*
the daemon; deadlines, TTL and progress polling are the daemon's timeout. After a restart kopf
resumes a daemon for every existing job, which then reconciles from cluster state.
"""

from __future__ import annotations

import asyncio
import logging
import math

import kopf
from kubernetes.client import ApiException

from . import manifests, status
from .kube import Kube
from .metrics import OperatorMetrics
from .reconcile import reconcile
from .spec import GROUP, PLURAL, VERSION

#: Seconds between progress polls of a running job's chief.
PROGRESS_POLL_S = 5.0
#: Seconds before retrying after an API error.
ERROR_RETRY_S = 5.0
PREFIX = "ringtrain.io"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    """Keep kopf's own bookkeeping under ringtrain.io and out of the status we own."""
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # handler log lines at WARNING+ become Events


@kopf.on.login()
def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    """kopf talks to the API with exactly the credentials the operator loaded (``--kubeconfig``
    or in-cluster), not with kopf's own guess from ``$KUBECONFIG`` at import time."""
    return connection_info(memo.kube.api_client.configuration)


def connection_info(cfg) -> kopf.ConnectionInfo:
    """kopf's ConnectionInfo from a ``kubernetes.client.Configuration``."""
    header = (cfg.get_api_key_with_prefix("BearerToken")
              or cfg.get_api_key_with_prefix("authorization") or "")
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        username=cfg.username or None, password=cfg.password or None,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def run_job(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo,
                  stopped: kopf.DaemonStopped, logger: kopf.Logger, **_) -> None:
    poke = memo.pokes.setdefault((namespace, name), asyncio.Event())
    while not stopped:
        poke.clear()
        try:
            decision = await asyncio.to_thread(
                reconcile, memo.kube, namespace, name, metrics=memo.metrics)
        except ApiException as e:
            logger.warning(f"reconcile failed, retrying in {ERROR_RETRY_S}s: {e.status} {e.reason}")
            decision = status.Decision(status={}, requeue_after_s=ERROR_RETRY_S)
        except Exception:  # a bug must not take the job's daemon (or the operator) down
            logger.exception(f"reconcile crashed, retrying in {ERROR_RETRY_S}s")
            decision = status.Decision(status={}, requeue_after_s=ERROR_RETRY_S)
        if decision is None or decision.delete_job:
            return
        for ev in decision.events:
            kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)
        await _wait(poke, stopped, _timeout(decision))


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def forget_job(name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    memo.pokes.pop((namespace, name), None)
    memo.metrics.forget(namespace, name)


@kopf.on.event("", "v1", "pods", labels={manifests.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_) -> None:
    if poke := memo.pokes.get((namespace, labels[manifests.LABEL_JOB])):
        poke.set()


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    if poke := memo.pokes.get((namespace, name)):
        poke.set()


def _timeout(decision: status.Decision) -> float | None:
    """Poll progress while the job is live; otherwise only its deadline/TTL wakes it."""
    live = decision.status.get("state") in (status.CREATED, status.RUNNING, status.RESTARTING)
    t = min(decision.requeue_after_s or math.inf, PROGRESS_POLL_S if live else math.inf)
    return None if t == math.inf else max(t, 0.05)


async def _wait(poke: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float | None) -> None:
    tasks = {asyncio.ensure_future(poke.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def new_memo(kube: Kube, metrics: OperatorMetrics) -> kopf.Memo:
    return kopf.Memo(kube=kube, metrics=metrics, pokes={})
