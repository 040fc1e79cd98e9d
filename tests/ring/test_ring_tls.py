"""Mutual TLS on the ring, real processes on loopback: the job's members train over it; a
stranger without a certificate, a certificate from another job's CA and garbage bytes are
refused in the handshake, before any handler or ring state, and the ring's result is unchanged."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import ring_procs
from support.ports import free_ports
from test_ring_processes import STEP_SIZES

from ringtrain import pki
from ringtrain.cluster import ClusterSpec, split_address
from ringtrain.errors import EXIT_PERMANENT, PeerTimeout, Unauthenticated
from ringtrain_trainer.ring import auth, connect, tls
from ringtrain_trainer.ring.grpc_transport import call_metadata
from ringtrain_trainer.ring.links import connect_with_backoff
from ringtrain_trainer.ring.protocol import Kind, OpHeader


def _go(ring: ring_procs.Ring) -> list:
    ring.go(1)
    return ring.finish()


@pytest.mark.timeout(60)
def test_a_grpc_ring_with_mutual_tls_trains_like_any_other(tmp_path):
    ring = ring_procs.start(3, "worker", "grpc", tls_dir=ring_procs.write_tls(tmp_path / "tls"))
    try:
        results = ring.finish()
    finally:
        ring.kill()
    for rank, (code, events) in enumerate(results):  # worker_sequence checks every value
        assert code == 0, f"rank {rank}: {events}"
        assert events[-1] == {"event": "done", "rank": rank, "refused": 0}


@pytest.mark.timeout(60)
def test_strangers_forged_certificates_and_garbage_never_reach_the_grpc_ring(tmp_path):
    ring = ring_procs.start(2, "pause", "grpc", tls_dir=ring_procs.write_tls(tmp_path / "job"))
    try:
        assert [ring.event(r)["event"] for r in (0, 1)] == ["ready", "ready"]
        target = ring.addresses[0]
        good = OpHeader(Kind.ALLREDUCE, len(STEP_SIZES), 2, 0, STEP_SIZES[0])
        md = call_metadata(ring.token, 1, 2, good)  # even with the right token
        job = tls.load(tmp_path / "job")
        forged = tls.Material.of(pki.create("ring", "default", "ring"))  # same names, other CA
        for who, material in [("no certificate", None), ("another job's CA", forged)]:
            with tls.channel(target, material) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    ch.stream_unary("/ringtrain.Ring/Push")(
                        iter([b"\0" * 4]), metadata=md, timeout=3
                    )
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, who
        # a client that trusts another CA refuses the job's server as well
        wrong_ca = tls.Material(forged.ca_cert, job.cert, job.key, job.identity, job.server_name)
        with tls.channel(target, wrong_ca) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/ringtrain.Ring/Hello")(b"", metadata=md[:3], timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        host, port = split_address(target)
        for garbage in (
            b"\x16\x03\x01\x00\x05hello",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" * 4,
            bytes(range(256)) * 8,
        ):
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(garbage)
                s.settimeout(5)
                try:
                    while s.recv(4096):
                        pass
                except ConnectionResetError:
                    pass  # closed, either way
        # inside mutual TLS the token is still checked: a handler refusal, counted
        with tls.channel(target, job) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/ringtrain.Ring/Hello")(
                    b"", metadata=call_metadata(b"wrong", 1, 2), timeout=5
                )
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        results = _go(ring)
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results  # every value checked by the worker
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 1}


@pytest.mark.timeout(60)
def test_a_worker_of_another_job_cannot_join_a_tls_ring(tmp_path):
    ring = ring_procs.start(2, "pause", "grpc", tls_dir=ring_procs.write_tls(tmp_path / "job"))
    try:
        assert [ring.event(r)["event"] for r in (0, 1)] == ["ready", "ready"]
        spec = ClusterSpec(
            cluster={"worker": (f"127.0.0.1:{free_ports(1)[0]}", ring.addresses[0])}, task_index=0
        )
        with pytest.raises(PeerTimeout):  # its Register never gets through the handshake
            connect(
                spec,
                ring.token,
                transport="grpc",
                connect_timeout_s=2,
                tls=pki.create("ring", "default", "ring"),
            )
        results = _go(ring)
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results


@pytest.mark.timeout(60)
def test_encrypted_tcp_side_channel_reduces_exactly_and_refuses_plain_peers(tmp_path):
    ring = ring_procs.start(
        2, "pause", "grpc+tcp", "--encrypt-data", tls_dir=ring_procs.write_tls(tmp_path / "job")
    )
    try:
        ready = [ring.event(r) for r in (0, 1)]
        assert [e["event"] for e in ready] == ["ready", "ready"]
        host, _ = split_address(ring.addresses[0])
        side = f"{host}:{ready[0]['data_port']}"  # announced over the mutual-TLS control plane
        with socket.create_connection((host, ready[0]["data_port"]), timeout=10) as s:
            s.settimeout(10)  # plain TCP, no TLS: the HMAC hello never comes
            with pytest.raises((ConnectionError, OSError)):
                auth.client_handshake(s, ring.token, 1, 2, "rank 0")
        t0 = time.monotonic()
        forged = tls.Material.of(pki.create("ring", "default", "ring"))  # another job's CA
        with pytest.raises(Unauthenticated, match="TLS failed") as e:
            connect_with_backoff(side, ring.token, 1, 2, 20, forged)
        assert e.value.exit_code == EXIT_PERMANENT and time.monotonic() - t0 < 10
        results = _go(ring)
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 2}


def test_encrypt_data_without_material_is_refused_before_any_socket():
    from ringtrain.errors import InvalidSpec

    spec = ClusterSpec(cluster={"worker": ("127.0.0.1:1", "127.0.0.1:2")}, task_index=0)
    with pytest.raises(InvalidSpec, match="encrypt-data needs"):
        connect(spec, b"t", encrypt_data=True)


class _Context:
    def __init__(self, sans):
        self._sans = sans

    def auth_context(self):
        return {"x509_subject_alternative_name": self._sans}


def test_servers_compare_the_callers_job_identity_after_the_handshake():
    job = tls.Material.of(pki.create("ring", "default", "ring", "uid-1"))
    other = pki.identity_uri("ring", "default", "uid-2")
    assert tls.peer_ok(_Context([b"localhost", job.identity.encode()]), job)
    assert not tls.peer_ok(_Context([b"localhost", other.encode()]), job)
    assert not tls.peer_ok(_Context([]), job)
    assert tls.peer_ok(_Context([]), None)  # TLS off: the token is the only check


@pytest.mark.timeout(60)
def test_health_answers_the_jobs_certificate_on_the_ring_port_and_anyone_on_the_health_port(
    tmp_path,
):
    from ringtrain_trainer.ring import probe

    health_port = free_ports(1)[0]
    ring = ring_procs.start(
        2,
        "pause",
        "grpc+tcp",
        tls_dir=ring_procs.write_tls(tmp_path / "j"),
        extra={0: ["--health-port", str(health_port)]},
    )
    try:
        assert [ring.event(r)["event"] for r in (0, 1)] == ["ready", "ready"]
        job = tls.load(tmp_path / "j")
        assert probe.check(ring.addresses[0], material=job) == "SERVING"
        assert probe.check(ring.addresses[0], "ringtrain.Ring", material=job) == "SERVING"
        assert probe.check(ring.addresses[0], timeout_s=1) != "SERVING"  # no certificate
        assert probe.check(f"127.0.0.1:{health_port}", "ringtrain.Ring") == "SERVING"
        results = _go(ring)
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results
