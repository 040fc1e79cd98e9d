"""float16 gradients on the wire (``--allreduce-dtype float16``): a real two-member ring on
loopback, each data path, counting the bytes the ring engine sent and received — half of a
float32 allreduce of the same tensor, with the float16 mean as the answer. A peer reducing
float32 at the same position is refused, never mixed in."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.ports import loopback_addresses

from ringtrain import cluster
from ringtrain.errors import RingtrainError
from ringtrain_trainer import ring
from ringtrain_trainer.ring.observer import RingObserver

N = 300_001  # odd: uneven segments


class Bytes(RingObserver):
    def __init__(self):
        self.sent = self.received = 0

    def collective(self, kind, seconds, sent_bytes, received_bytes):
        if kind == "allreduce":
            self.sent += sent_bytes
            self.received += received_bytes


def _run(transport: str, shm: bool, dtypes: tuple, timeout_s: float = 20):
    addresses, token = loopback_addresses(2), b"half-wire-token"
    out: list = [None, None]
    observers = [Bytes(), Bytes()]

    def member(rank: int) -> None:
        spec = cluster.parse(cluster.build({"worker": addresses}, "worker", rank))
        coll = ring.connect(
            spec,
            token,
            transport=transport,
            shared_memory=shm,
            observer=observers[rank],
            step_timeout_s=timeout_s,
            connect_timeout_s=20,
        )
        try:
            results = []
            for dtype in dtypes[rank]:
                buf = (np.arange(N) % 97 + 10 * rank).astype(dtype)
                coll.allreduce_mean_(buf, step=1, tag=0)
                results.append(buf)
            out[rank] = results
        except RingtrainError as e:
            out[rank] = e
        finally:
            coll.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, observers


@pytest.mark.parametrize(
    ("transport", "shm"), [("grpc+tcp", False), ("grpc+tcp", True), ("grpc", False)]
)
def test_float16_on_the_wire_halves_the_ring_bytes(transport, shm):
    out, obs = _run(transport, shm, ((np.float32, np.float16),) * 2)
    want = (np.arange(N) % 97 + 5).astype(np.float32)
    for rank in range(2):
        f32, f16 = out[rank]
        np.testing.assert_array_equal(f32, want)
        assert f16.dtype == np.float16
        np.testing.assert_array_equal(f16.astype(np.float32), want)  # exact in float16
    # each member: float32 then float16 of N elements; half the bytes the second time
    for o in obs:
        full = 4 * N  # a two-member ring sends and receives half the tensor twice
        assert o.sent == full + full // 2 or o.sent == full + (full + 2) // 2
        assert o.received in (full + full // 2, full + (full + 2) // 2)


def test_a_peer_reducing_float32_where_float16_is_due_is_refused():
    out, _ = _run("grpc+tcp", False, ((np.float16,), (np.float32,)), timeout_s=5)
    assert all(isinstance(r, RingtrainError) for r in out), out
