"""Shared fixtures of the trainer tests.

The test machine has two cores shared by several suites; OpenBLAS threads that spin while
another process holds a core make a step ~20x slower, so every trainer test runs numpy's BLAS
on one thread (results are bitwise the same; only the benchmark uses more).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from ringtrain_trainer import data as data_mod
from ringtrain_trainer.collective import Collective
from ringtrain.errors import PeerTimeout, RingError


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def mnist5k() -> data_mod.Dataset:
    return data_mod.load_mnist5k()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


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

    def collectives(self) -> list["ThreadCollective"]:
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


@pytest.fixture
def thread_group():
    return ThreadGroup
