"""An in-process collective for N ranks running as threads (tests only).

A module of its own, not ``conftest``: several test folders have a ``conftest.py``, and which one
``from conftest import ...`` finds depends on the order pytest collected them.
"""

from __future__ import annotations

import threading

import numpy as np

from ringtrain.errors import PeerTimeout, RingError
from ringtrain_trainer.collective import Collective

# An in-process collective for N ranks running as threads: a real mean over real buffers, used
# to test the reducer and multi-worker equivalence without gRPC (the gRPC ring has its own
# multi-process tests in tests/ring/). Like a real ring it checks that every rank calls the same
# collective with the same step, tag and size, and fails (never hangs) on a timeout.


class ThreadGroup:
    def __init__(self, size: int, timeout_s: float = 30.0):
        self.size = size
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def collectives(self) -> list[ThreadCollective]:
        return [ThreadCollective(self, r) for r in range(self.size)]


class ThreadCollective(Collective):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size
        self.calls: list[tuple] = []

    def _wait(self, what: str) -> None:
        try:
            self.group.barrier.wait(self.group.timeout_s)
        except threading.BrokenBarrierError:
            raise PeerTimeout(f"rank {self.rank}: {what}: a peer did not arrive") from None

    def _exchange(self, key: tuple, buf: np.ndarray) -> list[np.ndarray]:
        self.group.slots[self.rank] = (key, buf.copy())
        self._wait(str(key))
        got = list(self.group.slots)
        self._wait(str(key))
        for r, (k, _) in enumerate(got):
            if k != key:
                raise RingError(f"rank {self.rank}: peer {r} called {k}, this rank {key}")
        return [b for _, b in got]

    def allreduce_mean_(self, buf, step=0, tag=0):
        self.calls.append(("allreduce", step, tag, buf.size))
        parts = self._exchange(("allreduce", step, tag, buf.size), buf)
        total = np.zeros_like(buf)
        for p in parts:
            total += p
        np.divide(total, np.float32(self.size), out=buf)

    def broadcast_(self, buf, root=0):
        self.calls.append(("broadcast", root, buf.size))
        parts = self._exchange(("broadcast", root, buf.size), buf)
        np.copyto(buf, parts[root])
