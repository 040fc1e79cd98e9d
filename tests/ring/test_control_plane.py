"""The ring's gRPC control plane with real processes on loopback: rendezvous and the readiness
barrier, Health, failures seen at once (Abort, health checks), stall reports, and refusal of
callers without the job's token."""

import signal
import subprocess
import time

import grpc
import pytest
import ring_procs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.ports import free_ports
from support.procs import CLI

from ringtrain import events
from ringtrain.errors import EXIT_RETRYABLE
from ringtrain_trainer.ring import control

STEP_TIMEOUT = "60"


def status(port: int) -> events.Status | None:
    return events.fetch_status(f"http://127.0.0.1:{port}/status", timeout_s=2)


def wait_for(what, predicate, timeout_s: float = 30, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)  # polling a live process, not standing in for synchronisation
    raise AssertionError(f"no {what} within {timeout_s} s")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_frozen_or_killed_worker_is_named_and_left_well_before_the_step_timeout(how):
    """N = 4, rank 2 frozen or killed: its neighbours (1, 3) find it (health checks, closed
    sockets) and tell everyone; rank 0, no neighbour of it, leaves too. All name a peer and
    exit retryable within seconds although the step timeout is 60 s."""
    ring = ring_procs.start(
        4,
        "loop",
        "grpc+tcp",
        "--sizes",
        "300000",
        "--chunk-bytes",
        "65536",
        "--step-timeout-s",
        STEP_TIMEOUT,
        "--health-timeout-s",
        "2",
    )
    try:
        assert [ring.event(r)["event"] for r in range(4)] == ["started"] * 4
        t0 = time.monotonic()
        ring.procs[2].send_signal(getattr(signal, how))
        errors = {r: ring.event(r) for r in (0, 1, 3)}
        elapsed = time.monotonic() - t0
    finally:
        ring.kill()
    lost = ring.addresses[2]
    for r, e in errors.items():
        assert e["event"] == "error" and e["exit_code"] == EXIT_RETRYABLE, e
        assert f"rank {r} " in e["message"], e
    for r in (1, 3):  # the neighbours name the lost worker itself
        assert lost in errors[r]["message"] or "worker-2" in errors[r]["message"], errors[r]
    if how == "SIGSTOP":
        assert any("health check" in errors[r]["message"] for r in (1, 3)), errors
    assert "left the ring" in errors[0]["message"], errors[0]  # told over gRPC (Abort)
    assert elapsed < 5.0, (elapsed, errors)


@pytest.mark.timeout(60)
def test_an_early_worker_waits_names_the_missing_ranks_and_trains_once_they_come():
    port = free_ports(1)[0]
    ring = ring_procs.start(
        3,
        "allreduce",
        "grpc+tcp",
        ranks=[0],
        extra={0: ["--metrics-port", str(port), "--connect-timeout-s", "40"]},
    )
    try:
        st = wait_for("waiting_for in /status", lambda: (s := status(port)) and s.waiting_for and s)
        assert st.waiting_for == ["worker-1", "worker-2"], st
        ring.start_rank(1)
        wait_for(
            "worker-2 alone missing", lambda: (s := status(port)) and s.waiting_for == ["worker-2"]
        )
        time.sleep(3)  # the late worker really comes seconds later
        assert status(port).waiting_for == ["worker-2"]
        ring.start_rank(2)
        results = ring.finish()
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0, 0], results
    assert all(ev[-1]["event"] == "done" for _, ev in results), results


@pytest.mark.timeout(60)
def test_health_stall_reports_and_strangers_on_the_control_service():
    """Rank 1 holds step 2 (waits for our "go"); meanwhile rank 0, stall threshold 1 s, reports
    in /status and its metric that worker-1 has not delivered step 2 tag 0; Health answers
    SERVING (also through `ringtrain health`); Register, Abort and State without or with a
    wrong token are refused, and none of it disturbs the ring."""
    port = free_ports(1)[0]
    ring = ring_procs.start(
        2, "pause", "grpc+tcp", "--stall-s", "1", extra={0: ["--metrics-port", str(port)]}
    )
    try:
        assert [ring.event(r)["event"] for r in (0, 1)] == ["ready", "ready"]
        st = wait_for("a stall report", lambda: (s := status(port)) and s.stalled and s)
        assert (st.stalled["step"], st.stalled["tag"]) == (2, 0), st.stalled
        assert [m["name"] for m in st.stalled["missing"]] == ["worker-1"], st.stalled
        with grpc.insecure_channel(ring.addresses[0]) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", control.RING_HEALTH):
                got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert got.status == health_pb2.HealthCheckResponse.SERVING
            for method in ("Register", "Abort", "State"):
                call = ch.unary_unary(f"/{control.SERVICE}/{method}")
                for md in (
                    control.call_metadata(b"wrong", 1, 2),
                    control.call_metadata(ring.token, 1, 2)[1:],
                ):
                    with pytest.raises(grpc.RpcError) as e:
                        call(b"stop", metadata=md, timeout=10)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        probe = subprocess.run(
            [*CLI, "health", "--address", ring.addresses[0]],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.returncode == 0 and "SERVING" in probe.stdout, probe
        metrics = (
            __import__("urllib.request")
            .request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert 'ringtrain_ring_stalls_total{transport="grpc+tcp"}' in metrics
        ring.go(1)
        results = ring.finish()
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 6}
    dead = subprocess.run(
        [
            *CLI,
            "health",
            "--address",
            ring.addresses[0],
            "--timeout-s",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dead.returncode == 1, dead
