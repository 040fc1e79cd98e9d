"""The grpc+tcp side channel's key, real processes on loopback with the job's mutual TLS: each
listener's own random key, learnt only through the control plane, so a handshake recorded at an
earlier rendezvous of the same job, that rendezvous's key, or the job's token open nothing."""

from __future__ import annotations

import socket

import grpc
import pytest
import ring_procs

from ringtrain.cluster import split_address
from ringtrain_trainer.ring import auth, control

WORLD = 3  # rank 0's left neighbour is rank 2; rank 1 is a member that may not connect there


class Recording:
    """A socket whose sent bytes are kept: a wiretap on one client handshake."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent = sock, b""

    def recv_into(self, view) -> int:
        return self.sock.recv_into(view)

    def sendall(self, data) -> None:
        self.sent += bytes(data)
        self.sock.sendall(data)


def side_channel(ring: ring_procs.Ring) -> tuple[str, int, bytes]:
    """Rank 0's side channel as its left neighbour learns it: host, port, key."""
    answer = ring_procs.register(ring, 0, as_rank=WORLD - 1)
    return (
        split_address(ring.addresses[0])[0],
        answer["data_port"],
        bytes.fromhex(answer["data_key"]),
    )


def handshake(host: str, port: int, key: bytes) -> tuple[Exception, bytes]:
    """A full client handshake as rank 0's left neighbour: (its outcome, the bytes it sent)."""
    with socket.create_connection((host, port), timeout=10) as s:
        tap = Recording(s)
        with pytest.raises((auth.Unauthenticated, ConnectionError)) as e:
            auth.client_handshake(tap, key, WORLD - 1, WORLD, "rank 0")
        return e.value, tap.sent


def replay(host: str, port: int, recorded: bytes) -> bytes:
    """The recorded client message sent after a fresh hello; everything the server answers."""
    with socket.create_connection((host, port), timeout=10) as s:
        assert auth.recv_exact(s, 21).startswith(b"RTRH")
        s.sendall(recorded)
        return b"".join(iter(lambda: s.recv(64), b""))


@pytest.mark.timeout(90)
def test_a_side_channel_handshake_or_key_from_an_earlier_rendezvous_is_refused(tmp_path):
    tls_dir = ring_procs.write_tls(tmp_path / "job")
    first = ring_procs.start(WORLD, "pause", "grpc+tcp", tls_dir=tls_dir)
    try:
        assert [first.event(r)["event"] for r in range(WORLD)] == ["ready"] * WORLD
        host, port, old_key = side_channel(first)
        # the key is the listener's: accepted (the left neighbour is connected already)
        outcome, recorded = handshake(host, port, old_key)
        assert isinstance(outcome, ConnectionError) and "already connected" in str(outcome)
        assert len(recorded) == 8 + 16 + 32  # rank and size, client nonce, MAC
        first.go(1)
        assert [code for code, _ in first.finish()] == [0] * WORLD
    finally:
        first.kill()

    # The gang again: same job (token, CA, certificate), new processes, a new rendezvous.
    again = ring_procs.start(WORLD, "pause", "grpc+tcp", tls_dir=tls_dir, token=first.token)
    try:
        assert [again.event(r)["event"] for r in range(WORLD)] == ["ready"] * WORLD
        host, port, key = side_channel(again)
        assert key != old_key
        # 1: the recorded handshake, replayed
        assert replay(host, port, recorded) == bytes([auth.REFUSED_TOKEN])
        # 2: a fresh handshake with the earlier rendezvous's key
        outcome, _ = handshake(host, port, old_key)
        assert isinstance(outcome, auth.KeyRefused) and "wrong token" in str(outcome)
        # 3: the job's token instead of the rendezvous key
        outcome, _ = handshake(host, port, again.token)
        assert isinstance(outcome, auth.KeyRefused)
        # the key of this rendezvous is the one accepted
        outcome, _ = handshake(host, port, key)
        assert "already connected" in str(outcome)
        # the key goes only to the left neighbour, and only inside mutual TLS
        assert "data_key" not in ring_procs.register(again, 0, as_rank=1)
        with grpc.insecure_channel(again.addresses[0]) as ch, pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(f"/{control.SERVICE}/Register")(
                b"", metadata=control.call_metadata(again.token, WORLD - 1, WORLD), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS, no handler ran
        again.go(1)
        results = again.finish()
    finally:
        again.kill()
    assert [code for code, _ in results] == [0] * WORLD, results
    # the replay, the old key and the token; the busy refusal of the real key counts too
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 4}
