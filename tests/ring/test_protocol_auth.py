"""The collective header and the TCP handshake, over real socket pairs."""

import socket
import threading

import pytest

from ringtrain.errors import Unauthenticated
from ringtrain_trainer.ring import auth
from ringtrain_trainer.ring.protocol import HEADER_BYTES, Kind, Mismatch, OpHeader


def test_header_round_trips_and_rejects_garbage():
    h = OpHeader(Kind.BROADCAST, seq=7, step=-1, tag=3, nelem=1 << 40, root=2)
    assert len(h.pack()) == HEADER_BYTES
    assert OpHeader.unpack(h.pack()) == h
    assert OpHeader.unpack(b"x" * HEADER_BYTES) is None
    assert OpHeader.unpack(h.pack()[:-1]) is None


def test_header_mismatch_names_what_differs():
    h = OpHeader(Kind.ALLREDUCE, seq=4, step=10, tag=1, nelem=100)
    assert h.mismatch(h) is None
    assert OpHeader(Kind.ALLREDUCE, 5, 10, 1, 100).mismatch(h) is Mismatch.SEQUENCE
    assert OpHeader(Kind.BROADCAST, 4, 10, 1, 100).mismatch(h) is Mismatch.SEQUENCE
    assert OpHeader(Kind.ALLREDUCE, 4, 11, 1, 100).mismatch(h) is Mismatch.STEP
    assert OpHeader(Kind.ALLREDUCE, 4, 10, 2, 100).mismatch(h) is Mismatch.STEP
    assert OpHeader(Kind.ALLREDUCE, 4, 10, 1, 99).mismatch(h) is Mismatch.SIZE


def test_a_member_restarted_in_place_cannot_join_a_stale_ring():
    """A restarted process starts its collectives at seq 0 with the chief's state broadcast; a
    peer not yet restarted is far along. Either side refuses the other's header, fails with the
    retryable ring error and restarts, until the whole gang starts again from seq 0."""
    fresh = OpHeader(Kind.BROADCAST, seq=0, step=0, tag=0, nelem=1000, root=0)
    stale = OpHeader(Kind.ALLREDUCE, seq=5731, step=1910, tag=2, nelem=1000)
    assert fresh.mismatch(stale) is Mismatch.SEQUENCE
    assert stale.mismatch(fresh) is Mismatch.SEQUENCE
    # Two restarted members agree: the gang re-forms from the same first collective.
    assert fresh.mismatch(OpHeader(Kind.BROADCAST, 0, 0, 0, 1000, 0)) is None


def handshake(server_token: bytes, client_token: bytes, rank: int = 1, world: int = 2):
    """Run both ends of the handshake on a socketpair; returns (server verdict, client error)."""
    s, c = socket.socketpair()
    s.settimeout(5)
    c.settimeout(5)
    verdict = []
    t = threading.Thread(
        target=lambda: verdict.append(
            auth.server_handshake(s, server_token, world=2, accept_rank=lambda r: auth.OK)
        )
    )
    t.start()
    err = None
    try:
        auth.client_handshake(c, client_token, rank, world, "peer")
    except Unauthenticated as e:
        err = e
    t.join()
    s.close()
    c.close()
    return verdict[0][0], err


def test_handshake_accepts_the_same_token():
    assert handshake(b"secret", b"secret") == (auth.OK, None)


def test_handshake_refuses_a_wrong_token_on_both_sides():
    verdict, err = handshake(b"secret", b"guess")
    assert verdict == auth.REFUSED_TOKEN
    assert "wrong token" in str(err)


def test_handshake_refuses_another_ring_size():
    verdict, err = handshake(b"secret", b"secret", world=3)
    assert verdict == auth.REFUSED_WORLD
    assert "different ring size" in str(err)


def test_token_comparison_never_matches_a_missing_token():
    assert auth.token_ok(b"a", b"a")
    assert not auth.token_ok(None, b"a")
    assert not auth.token_ok(b"b", b"a")


def test_client_refuses_a_server_that_does_not_speak_the_protocol():
    s, c = socket.socketpair()
    s.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    c.settimeout(5)
    with pytest.raises(Unauthenticated, match="same ring transport"):
        auth.client_handshake(c, b"t", 0, 2, "peer")
    s.close()
    c.close()


def test_every_listener_has_its_own_key_and_a_refused_key_is_retryable():
    """A key from the peer's own rendezvous answer is refused only by a restarted peer (a new
    listener, a new key): the gang restarts (retryable), the job does not fail for good."""
    from ringtrain.errors import EXIT_RETRYABLE, RingError
    from ringtrain_trainer.ring.links import Listener, connect_with_backoff

    first, second = (Listener(0, 2, 1, "127.0.0.1", fallback=True) for _ in range(2))
    try:
        assert len(first.key) == auth.KEY_BYTES and first.key != second.key
        with pytest.raises(RingError, match="restarted since") as e:
            connect_with_backoff(f"127.0.0.1:{second.port}", first.key, 1, 2, 10)
        assert not isinstance(e.value, Unauthenticated)
        assert e.value.exit_code == EXIT_RETRYABLE
        connect_with_backoff(f"127.0.0.1:{first.port}", first.key, 1, 2, 10).close()
        left = first.wait_left(5)
        assert left is not None and (first.refused, second.refused) == (0, 1)
        left.close()
    finally:
        first.close()
        second.close()


def test_the_client_tells_a_refused_key_from_other_refusals():
    verdict, err = handshake(b"listener's key", b"job token")
    assert verdict == auth.REFUSED_TOKEN and isinstance(err, auth.KeyRefused)
    verdict, err = handshake(b"k", b"k", world=3)
    assert verdict == auth.REFUSED_WORLD and not isinstance(err, auth.KeyRefused)
