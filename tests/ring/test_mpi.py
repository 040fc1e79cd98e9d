"""The Open MPI backend under a real ``mpirun`` (Debian's Open MPI, mpi4py)."""

import subprocess
import sys

import pytest

PROGRAM = """
import numpy as np
from trainer.mpi import connect
c = connect()
buf = np.arange(7, dtype=np.float32) * (c.rank + 1)
c.allreduce_mean_(buf, step=1, tag=0)
want = np.arange(7, dtype=np.float32) * sum(range(1, c.size + 1)) / c.size
assert np.allclose(buf, want), (c.rank, buf, want)
b = np.full(5, c.rank, np.float32)
c.broadcast_(b, root=1)
assert (b == 1).all(), (c.rank, b)
c.barrier()
c.close()
print("ok", c.rank, c.size, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpirun_two_ranks_mean_allreduce_and_broadcast():
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
         sys.executable, "-c", PROGRAM],
        capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split("\n")[:2]) == ["ok 0 2", "ok 1 2"]
