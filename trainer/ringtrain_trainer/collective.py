"""The collective interface the training loop talks to, and its one-process implementation.

The step loop never knows whether it runs alone, on the ring or under MPI: it calls these
methods on float32 numpy buffers, in place. ``trainer.ring`` provides the ring (gRPC control
plane; data path ``grpc+tcp`` or ``grpc``),
``trainer.mpi`` the Open MPI backend (the seeds' Horovod path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ringtrain_trainer import trace


class Collective(ABC):
    """Synchronous collectives over the ring members, all in place on contiguous float32 arrays.

    Calls must be made in the same order on every rank (as with NCCL/gloo). ``step`` tags the
    call so a peer that is a step ahead or behind is refused rather than mixed in.
    """

    rank: int = 0
    size: int = 1
    #: When a list, the collective appends to it the (start, end) ``time.perf_counter`` pairs of
    #: the time it spent blocked on a peer (waiting for its data); the reducer sets it so that
    #: waiting is never counted as communication hidden behind backward. A collective that
    #: cannot tell (Open MPI) leaves it untouched.
    peer_waits: list | None = None
    #: the worker's ``ringtrain_trainer.trace.Tracer``; the ring records its phases and waits
    tracer: trace.Tracer = trace.OFF

    @abstractmethod
    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        """Replace ``buf`` with the element-wise mean of every rank's ``buf``."""

    @abstractmethod
    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        """Replace ``buf`` on every rank with ``root``'s ``buf``."""

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.broadcast_(np.zeros(1, np.float32))

    def fail(self, reason: str, exit_code: int = 1) -> None:  # noqa: B027 - an optional hook: a no-op unless overridden
        """This member leaves because of a failure (``exit_code``: the one it exits with): tell
        the others, so that they leave at once instead of waiting for a timeout (the ring
        does; nothing to tell here)."""

    def close(self) -> None:  # noqa: B027 - an optional hook: a no-op unless overridden
        """Release sockets and threads; idempotent."""


class LocalCollective(Collective):
    """One process: every collective is the identity (Horovod registers no hooks for size 1)."""

    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        pass

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        pass
