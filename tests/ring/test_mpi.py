"""The Open MPI backend under a real ``mpirun`` (Debian's Open MPI, mpi4py)."""

import subprocess
import sys

import pytest
from support import procs as procs_mod

PROGRAM = """
import sys
import numpy as np
from ringtrain_trainer.mpi import connect
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
open(f"{sys.argv[1]}/rank-{c.rank}", "w").write(f"ok {c.rank} {c.size}")
"""


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpirun_two_ranks_mean_allreduce_and_broadcast(tmp_path):
    # One file per rank: mpirun forwards the ranks' stdout in pieces that may interleave.
    out = subprocess.run(
        [
            *procs_mod.mpirun(2),
            sys.executable,
            "-c",
            PROGRAM,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results = sorted(p.read_text() for p in tmp_path.glob("rank-*"))
    assert results == ["ok 0 2", "ok 1 2"], out.stdout + out.stderr
