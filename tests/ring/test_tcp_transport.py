"""``TcpTransport``'s own byte handling over a connected socket pair, no ring around it: the
header read with the first chunk, checked before anything touches the caller's buffer, and
writes from the calling thread that never block."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from ringtrain_trainer.ring.protocol import Kind, OpHeader
from ringtrain_trainer.ring.tcp import TcpTransport
from ringtrain_trainer.ring.transport import LinkError


class _NoListener:
    refused = 0

    def close(self) -> None:
        pass


@pytest.fixture
def pair():
    """(sender, receiver): the sender's right socket is the receiver's left one."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()  # the unused directions
    tx = TcpTransport(_NoListener(), a, c, step_timeout_s=2)
    rx = TcpTransport(_NoListener(), d, b, step_timeout_s=2)
    yield tx, rx
    tx.close()
    rx.close()


def _header(seq: int, nelem: int) -> OpHeader:
    return OpHeader(Kind.ALLREDUCE, seq, 3, 0, nelem, 0)


def test_the_header_and_first_chunk_arrive_in_one_write_and_add_in_place(pair):
    tx, rx = pair
    data = np.arange(8, dtype=np.float32)
    parts = [memoryview(_header(0, 8).pack()), memoryview(data).cast("B")]
    assert tx.send_now(parts) == sum(len(p) for p in parts)
    out = np.ones(8, np.float32)
    rx.begin_recv(_header(0, 8))
    rx.recv_add(out)
    rx.end_recv()
    assert np.array_equal(out, data + 1)


@pytest.mark.parametrize("receive", ["recv_add", "recv_copy", "end_recv"])
def test_a_header_of_another_collective_is_refused_before_the_buffer_is_touched(pair, receive):
    tx, rx = pair
    data = np.full(8, 7, np.float32)
    tx.send_now([memoryview(_header(5, 8).pack()), memoryview(data).cast("B")])
    out = np.ones(8, np.float32)
    rx.begin_recv(_header(4, 8))
    with pytest.raises(LinkError, match=r"peer is at allreduce #5 .*this rank at allreduce #4"):
        getattr(rx, receive)(*([out] if receive != "end_recv" else []))
    assert np.array_equal(out, np.ones(8, np.float32))


def test_garbage_instead_of_a_header_is_refused(pair):
    tx, rx = pair
    tx.send_now([memoryview(b"x" * 72)])
    rx.begin_recv(_header(0, 8))
    out = np.ones(8, np.float32)
    with pytest.raises(LinkError, match="malformed"):
        rx.recv_add(out)
    assert np.array_equal(out, np.ones(8, np.float32))


def test_a_write_from_the_calling_thread_takes_what_fits_and_never_blocks(pair):
    tx, _ = pair
    big = memoryview(bytearray(64 << 20))  # more than any socket buffer holds
    sent = tx.send_now([big])
    assert 0 < sent < len(big)
    assert tx.send_now([big[sent:]]) == 0  # full: nothing, at once


def test_a_chunk_split_across_arrivals_is_completed_by_blocking_receives(pair):
    tx, rx = pair
    data = np.arange(1 << 16, dtype=np.float32)
    raw = memoryview(data).cast("B")
    tx.send_now([memoryview(_header(0, data.size).pack()), raw[:1000]])
    later = threading.Timer(0.2, lambda: tx.send(raw[1000:]))
    later.start()
    out = np.zeros_like(data)
    rx.begin_recv(_header(0, data.size))
    rx.recv_copy(out)
    later.join()
    assert np.array_equal(out, data)


def test_a_closed_peer_is_a_link_error(pair):
    tx, rx = pair
    tx.close()
    rx.begin_recv(_header(0, 8))
    with pytest.raises(LinkError, match="closed"):
        rx.recv_add(np.ones(8, np.float32))
