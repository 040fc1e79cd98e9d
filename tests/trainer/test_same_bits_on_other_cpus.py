"""The streamed gradient's bits do not depend on the piece grid on any CPU (issue 34): a
newcomer's AMD EPYC (AVX2, no AVX-512) runs the AVX2 kernel set and OpenBLAS's Zen or Haswell
kernels, which sum a block of a product's rows in another order than the whole product. This
machine stands in for those CPUs by choosing the same kernels (OpenBLAS's core type, the engine's
kernel set) in a fresh process, and runs the grid test there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, pytest
from ringtrain_trainer.engine import native
native.force(sys.argv[1])  # as RINGTRAIN_KERNELS forces it
assert native.kernels.isa() == sys.argv[1], native.kernels.isa()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[2], "-k", "same_bits"]))
"""


@pytest.mark.parametrize(("coretype", "kernels"), [("Zen", "avx2"), ("Haswell", "avx2")])
def test_the_piece_grid_changes_no_bit_with_other_cpus_kernels(coretype, kernels):
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "trainer"), str(ROOT / "operator"), str(ROOT / "tests")]
    )
    test = str(ROOT / "tests/trainer/test_trainer_reducer.py")
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, kernels, test],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "1 passed" in p.stdout
