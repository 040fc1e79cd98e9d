"""The operator process: its health/metrics endpoint, flags and the daemon's wake-up timing."""

from __future__ import annotations

import asyncio
import urllib.request

from aiohttp import web
from prometheus_client import CollectorRegistry

from ringtrain_operator import handlers, main, status
from ringtrain_operator.metrics import OperatorMetrics


def test_healthz_and_metrics_are_served_from_the_operator_loop():
    metrics = OperatorMetrics(CollectorRegistry())
    metrics.created.labels("team-a").inc()

    async def scenario():
        runner = web.AppRunner(main.health_app(metrics))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]

        def get(path):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()

        try:
            return await asyncio.to_thread(get, "/healthz"), await asyncio.to_thread(get,
                                                                                    "/metrics")
        finally:
            await runner.cleanup()

    (hs, hbody), (ms, mbody) = asyncio.run(scenario())
    assert (hs, hbody) == (200, "ok\n")
    assert ms == 200
    assert 'ringtrain_operator_jobs_created_total{namespace="team-a"} 1.0' in mbody
    assert 'ringtrain_operator_info{version="0.1.0"} 1.0' in mbody


def test_scope_flags():
    assert main.parse_args([]).namespace == []
    args = main.parse_args(["-n", "a", "-n", "b", "--listen", "127.0.0.1:9000"])
    assert args.namespace == ["a", "b"] and args.listen == "127.0.0.1:9000"


def test_daemon_polls_live_jobs_and_sleeps_until_the_deadline_otherwise():
    live = status.Decision(status={"state": status.RUNNING}, requeue_after_s=60)
    assert handlers._timeout(live) == handlers.PROGRESS_POLL_S
    soon = status.Decision(status={"state": status.RUNNING}, requeue_after_s=1.5)
    assert handlers._timeout(soon) == 1.5
    ttl = status.Decision(status={"state": status.SUCCEEDED}, requeue_after_s=300)
    assert handlers._timeout(ttl) == 300
    assert handlers._timeout(status.Decision(status={"state": status.FAILED})) is None


def test_kopf_bookkeeping_lives_under_ringtrain_io():
    import kopf

    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert settings.persistence.finalizer == "ringtrain.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "ringtrain.io"
    assert settings.persistence.diffbase_storage.prefix == "ringtrain.io"


def test_memo_is_shared_by_the_daemon_and_the_pod_handler():
    import copy

    memo = handlers.new_memo(kube=None, metrics=OperatorMetrics(CollectorRegistry()))
    per_object = copy.copy(memo)  # what kopf hands each handler
    event = asyncio.Event()
    per_object.pokes[("ns", "job")] = event

    asyncio.run(handlers.pod_changed(namespace="ns", labels={"ringtrain.io/job-name": "job"},
                                     memo=memo))
    assert event.is_set()


def test_namespaced_mode_needs_no_cluster_wide_scanning():
    assert main.operator_settings(main.parse_args(["-n", "team-a"])).scanning.disabled is True
    assert main.operator_settings(main.parse_args([])).scanning.disabled is False


def test_kopf_logs_in_with_the_credentials_the_operator_loaded():
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = "https://192.0.2.2:6443"
    cfg.ssl_ca_cert = "/tmp/ca.crt"
    cfg.api_key = {"authorization": "Bearer s3cret"}
    info = handlers.connection_info(cfg)
    assert (info.server, info.ca_path, info.scheme, info.token) == (
        "https://192.0.2.2:6443", "/tmp/ca.crt", "Bearer", "s3cret")
    assert info.insecure is False
