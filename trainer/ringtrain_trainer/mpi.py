"""The Open MPI backend (the seeds' Horovod / ``IPUHorovodStrategy`` path) behind ``Collective``.

Under ``mpirun -np N ringtrain worker --collective mpi`` the ranks come from MPI, not TF_CONFIG,
and the data moves with Open MPI's own transports (shared memory on one host, TCP between
hosts). The training semantics stay those of the ring: mean allreduce in place, broadcast
from rank 0. mpi4py is an optional extra (``pip install ringtrain[mpi]``).
"""

from __future__ import annotations

import numpy as np

from ringtrain.cluster import ClusterSpec
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import Collective

_FLOAT = np.dtype(np.float32)


class MpiCollective(Collective):
    """Collectives on an mpi4py communicator, in place with ``MPI.IN_PLACE`` (no copies)."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._abort: int | None = None

    @staticmethod
    def _check(buf: np.ndarray, what: str) -> None:
        if not isinstance(buf, np.ndarray) or buf.dtype != _FLOAT or not buf.flags.c_contiguous:
            raise TypeError(f"{what}: needs a C-contiguous float32 numpy array")

    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        self._check(buf, "allreduce_mean_")
        if self.size == 1 or buf.size == 0:
            return
        self._comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
        np.divide(buf, self.size, out=buf)

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        self._check(buf, "broadcast_")
        if self.size > 1 and buf.size:
            self._comm.Bcast(buf, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()

    def fail(self, reason: str, exit_code: int = 1) -> None:
        """MPI has no way to leave a world: a rank that fails outside a collective leaves its
        peers blocked in their next one for ever (a restarted rank 0 refused its checkpoint
        directory did, its peer spinning in Allreduce). So the whole world is aborted with this
        rank's exit code — at :meth:`close`, once the rank has written its termination log —
        and mpirun ends every rank and exits with that code."""
        self._abort = exit_code

    def close(self) -> None:
        """MPI itself is finalised by mpi4py at interpreter exit; a failed rank aborts the
        world here (:meth:`fail`)."""
        if self._abort is not None and self.size > 1:
            self._comm.Abort(self._abort)


def connect(spec: ClusterSpec | None = None) -> Collective:
    """The world communicator of the ``mpirun`` that started this process.

    ``spec`` is accepted so callers can pass their TF_CONFIG uniformly, and ignored: under
    ``mpirun`` the ranks and the world size come from MPI.
    """
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise InvalidSpec(
            f"--collective mpi needs mpi4py and Open MPI ({e}); install "
            "ringtrain[mpi] and Debian's openmpi-bin libopenmpi-dev"
        ) from None
    return MpiCollective(MPI.COMM_WORLD)
