"""The same-host shared-memory links of ``grpc+tcp`` (``ring.shm``): when a link turns to shared
memory and when it must not. The ring over them in separate processes (odd sizes, N = 2…4,
killed and frozen peers, flat memory, metric labels) runs in test_ring_processes.py and
test_ring_metrics.py with ``grpc+shm``."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from ringtrain_trainer.ring import shm, shm_segment


def test_slots_hold_one_chunk_each_within_the_budget():
    assert shm_segment.plan(1 << 20) == (8, 1 << 20)
    assert shm_segment.plan(4 << 20) == (4, 4 << 20)
    assert shm_segment.plan(64 << 20) == (2, 64 << 20)
    assert shm_segment.plan(4) == (8, 64)  # rounded up to a cache line


def test_the_offered_segment_is_attached_and_shared():
    seg, fd, nonce = shm_segment.create(2, 4096)
    try:
        other = shm_segment.attach(os.getpid(), fd, nonce, 2, 4096)
        assert other is not None
        other.floats[1][:3] = [1, 2, 3]
        assert seg.floats[1][:3].tolist() == [1, 2, 3]  # one memory, not a copy
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", ["nonce", "size", "not-a-memfd", "no-such-pid"])
def test_a_segment_that_is_not_provably_the_offered_one_is_refused(case, tmp_path):
    """Another PID namespace (a pod) makes the offered pid and descriptor someone else's here:
    whatever they name, nothing but the offered memfd with its nonce and size is used."""
    _seg, fd, nonce = shm_segment.create(2, 4096)
    plain = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, shm_segment.Segment.size(2, 4096))
    try:
        args = {
            "nonce": (os.getpid(), fd, bytes(16), 2, 4096),
            "size": (os.getpid(), fd, nonce, 3, 4096),
            "not-a-memfd": (os.getpid(), plain, nonce, 2, 4096),
            "no-such-pid": (2**22 + 1, fd, nonce, 2, 4096),
        }[case]
        assert shm_segment.attach(*args) is None
    finally:
        os.close(fd)
        os.close(plain)


def _pairs(world: int) -> list[tuple[socket.socket, socket.socket]]:
    """(left, right) sockets of each rank of a ring on socketpairs."""
    links = [socket.socketpair() for _ in range(world)]  # link r: rank r -> rank r+1
    for a, b in links:
        a.settimeout(5)
        b.settimeout(5)
    return [(links[(r - 1) % world][1], links[r][0]) for r in range(world)]


def _negotiate(enabled: list[bool], chunk_bytes: int = 4096):
    pairs, got = _pairs(len(enabled)), {}

    def run(r: int) -> None:
        got[r] = shm.negotiate(*pairs[r], chunk_bytes, enabled[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(enabled))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for left, right in pairs:
        left.close()
        right.close()
    return [got[r] for r in range(len(enabled))]


def test_every_rank_offers_before_it_reads_so_a_ring_negotiates_without_deadlock():
    got = _negotiate([True, True, True])
    for r, (inbound, outbound) in enumerate(got):
        assert inbound is not None and outbound is not None
        right_in = got[(r + 1) % 3][0]
        outbound.floats[0][0] = 10 + r
        assert right_in.floats[0][0] == 10 + r  # what r fills, its right neighbour reads


def test_a_rank_with_shared_memory_off_keeps_both_its_links_on_tcp():
    got = _negotiate([True, False, True])
    assert got[1] == (None, None)
    assert got[0][1] is None and got[2][0] is None  # the links to and from rank 1
    assert got[2][1] is not None and got[0][0] is not None  # rank 2 -> rank 0 still shares


def test_the_receiver_refuses_a_slot_signal_out_of_order():
    """A "filled" byte naming another slot than the next one is a broken link, not data."""
    from ringtrain_trainer.ring.transport import LinkError

    t = shm.ShmTransport.__new__(shm.ShmTransport)
    a, b = socket.socketpair()
    t._left, t._left_fd, t._expect, t._taken = b, None, None, 0
    t._signal = bytearray(1)
    t._in, fd, _ = shm_segment.create(2, 64)
    os.close(fd)
    a.sendall(b"\x01")
    with pytest.raises(LinkError, match="filled slot 1, expected 0"):
        t.recv_add(np.zeros(4, np.float32))
    a.close()
    b.close()


def test_slots_given_back_to_a_sender_that_already_left_break_nothing():
    """The last collective of a job: the left neighbour finished (its chunks are in our own
    memory) and closed its socket before we hand its slots back; that is not a ring failure."""
    t = shm.ShmTransport.__new__(shm.ShmTransport)
    a, b = socket.socketpair()
    a.close()
    t._left, t._left_fd, t._unreported = b, b.fileno(), 1
    t._free(flush=True)
    assert t._unreported == 0
    b.close()


def test_a_neighbour_that_leaves_during_the_offer_is_the_one_named():
    """The right neighbour closes before answering: a link error of the send side (the engine
    names the right peer), not a hang and not a crash."""
    from ringtrain_trainer.ring.transport import LinkError

    (to_left, left), (right, from_right) = socket.socketpair(), socket.socketpair()
    for s in (left, right):
        s.settimeout(5)
    from_right.close()
    with pytest.raises(LinkError, match="right neighbour") as e:
        shm.negotiate(left, right, 4096, True)
    assert e.value.send_side
    for s in (to_left, left, right):
        s.close()
