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
            return await asyncio.to_thread(get, "/healthz"), await asyncio.to_thread(
                get, "/metrics"
            )
        finally:
            await runner.cleanup()

    (hs, hbody), (ms, mbody) = asyncio.run(scenario())
    assert (hs, hbody) == (200, "ok\n")
    assert ms == 200
    assert 'ringtrain_operator_jobs_created_total{job_namespace="team-a"} 1.0' in mbody
    assert 'ringtrain_operator_info{version="0.1.0"} 1.0' in mbody


def test_scope_flags():
    assert main.parse_args([]).namespace == []
    args = main.parse_args(["-n", "a", "-n", "b", "--listen", "127.0.0.1:9000"])
    assert args.namespace == ["a", "b"] and args.listen == "127.0.0.1:9000"


def test_daemon_polls_live_jobs_and_sleeps_until_the_deadline_otherwise():
    live = status.Decision(status={"state": status.RUNNING}, requeue_after_s=60)
    assert status.look_again_s(live) == status.LOOK_AGAIN_S[status.RUNNING] == 5.0
    soon = status.Decision(status={"state": status.RUNNING}, requeue_after_s=1.5)
    assert status.look_again_s(soon) == 1.5
    ttl = status.Decision(status={"state": status.SUCCEEDED}, requeue_after_s=300)
    assert status.look_again_s(ttl) == 300
    assert status.look_again_s(status.Decision(status={"state": status.FAILED})) is None
    for state in (status.CREATED, status.RESTARTING):
        assert status.look_again_s(status.Decision(status={"state": state})) == 5.0
    assert status.look_again_s(status.Decision(status={"state": status.SUSPENDED})) is None
    assert status.look_again_s(status.Decision(status={}, requeue_after_s=0.001)) == 0.05


def test_a_failed_reconcile_retries_soon_and_says_why_in_one_warning_event():
    from kubernetes.client import ApiException

    class Broken:
        def get_job(self, namespace, name):
            raise ApiException(status=503, reason="Service Unavailable")

    memo = handlers.new_memo(kube=Broken(), metrics=OperatorMetrics(CollectorRegistry()))
    d = handlers.reconcile_once(memo, "ns", "job")
    assert status.look_again_s(d) == status.ERROR_RETRY_S
    assert [(e.type, e.reason) for e in d.events] == [("Warning", status.REASON_RECONCILE_FAILED)]
    assert "503 Service Unavailable" in d.events[0].message
    memo = handlers.new_memo(kube=None, metrics=OperatorMetrics(CollectorRegistry()))
    crashed = handlers.reconcile_once(memo, "ns", "job")  # a bug: None has no get_job
    assert crashed.status == {} and not crashed.delete_job
    assert "reconcile crashed" in crashed.events[0].message


def test_a_reconciles_events_are_posted_aggregated_with_an_honest_count():
    """One Event per (type, reason) of a reconcile, its count the number aggregated: summing
    ``count`` still gives one PodCreated per pod (issue 22: 3 → 2 posts per new job)."""
    from ringtrain_operator import posting

    evs = (
        status.Event("Normal", "TrainingJobCreated", "created"),
        status.Event("Normal", "PodCreated", "created pod j-worker-0"),
        status.Event("Normal", "PodCreated", "created pod j-worker-1"),
        status.Event("Warning", "X", "y"),
        status.Event("Warning", "X", "z"),
    )
    got = [(e.reason, e.message, n) for e, n in posting.aggregate(evs)]
    assert got == [
        ("TrainingJobCreated", "created", 1),
        ("PodCreated", "created pods j-worker-0, j-worker-1", 2),
        ("X", "y; z", 2),
    ]
    ref = {"namespace": "ns", "name": "j", "uid": "u1"}
    body = posting.event_body(ref, status.Event("Warning", "X", "m" * 5000), 3)
    assert body["count"] == 3 and len(body["message"]) <= posting.MESSAGE_MAX
    assert body["involvedObject"] == {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        **ref,
    }
    assert body["metadata"]["namespace"] == "ns" and body["metadata"]["name"].startswith("j.")


def test_kopf_bookkeeping_lives_under_ringtrain_io():
    import logging

    import kopf

    settings = main.operator_settings(main.parse_args([]))
    assert settings.persistence.finalizer == "ringtrain.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "ringtrain.io"
    assert settings.persistence.diffbase_storage.prefix == "ringtrain.io"
    assert settings.posting.level == logging.WARNING
    assert not hasattr(handlers, "configure")  # kopf settings are made in one place


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
        "https://192.0.2.2:6443",
        "/tmp/ca.crt",
        "Bearer",
        "s3cret",
    )
    assert info.insecure is False


def test_reconcile_failures_in_a_row_back_off_to_five_minutes_and_warn_less_often():
    """Issue 20: a job whose every reconcile fails was retried every 5 s forever, with an
    Event each time. Now 5, 10, 20 … 300 s, a Warning on the 1st, 2nd, 4th, 8th … failure;
    one success resets both."""
    memo = handlers.new_memo(kube=None, metrics=OperatorMetrics(CollectorRegistry()))
    got = [handlers.reconcile_once(memo, "ns", "job") for _ in range(10)]
    assert [d.requeue_after_s for d in got] == [5, 10, 20, 40, 80, 160, 300, 300, 300, 300]
    assert [bool(d.events) for d in got] == [1, 1, 0, 1, 0, 0, 0, 1, 0, 0]
    assert "(8 in a row), retrying in 300s: AttributeError" in got[7].events[0].message
    memo.kube = type("Gone", (), {"get_job": lambda self, ns, name: None})()
    assert handlers.reconcile_once(memo, "ns", "job") is None  # a success: the count resets
    memo.kube = None
    assert handlers.reconcile_once(memo, "ns", "job").requeue_after_s == 5


def test_events_are_posted_off_the_reconcile_path_and_a_failed_post_is_only_logged(caplog):
    import threading

    from ringtrain_operator import posting

    got, done = [], threading.Event()

    class Kube:
        def create_event(self, namespace, body):
            got.append((namespace, body["reason"], body["count"]))
            if body["reason"] == "Refused":
                raise RuntimeError("403 Forbidden")
            done.set()

    evs = (
        status.Event("Warning", "Refused", "x"),
        status.Event("Normal", "PodCreated", "created pod j-worker-0"),
        status.Event("Normal", "PodCreated", "created pod j-worker-1"),
    )
    posting.post(Kube(), {"namespace": "ns", "name": "j", "uid": "u1"}, evs)
    assert done.wait(10)
    assert got == [("ns", "Refused", 1), ("ns", "PodCreated", 2)]
    assert "ns/j: Event Refused not posted: 403 Forbidden" in caplog.text
