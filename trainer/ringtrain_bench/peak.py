"""The machine's matmul peak, the denominator of every "% of peak" the benches print, and what
the machine is (CPU model, kernel set), which every bench line carries.

Why in a child process between timed blocks: OpenBLAS's threads spin for about 2^28 cycles
(~0.1 s, its THREAD_TIMEOUT) after a multi-threaded call before they sleep. Measured in the
bench's own process, they took a core from whichever side ran next: the seeds' CNN blocks went
from 0.34 s (the first, before any peak) to 0.40 s (every later one). A child that exits takes
its threads with it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ringtrain_trainer.engine import native


def matmul_peak_gflops(n: int = 512, seconds: float = 0.3, threads: int | None = None) -> float:
    """numpy's best float32 ``n``×``n`` matmul rate (512: its operands fit in L2/L3), with
    ``threads`` BLAS threads (None: BLAS's own count)."""
    limits = contextlib.nullcontext()
    if threads is not None:
        limits = threadpool_limits(limits=threads, user_api="blas")
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b, c = a.copy(), np.empty_like(a)
    with limits:
        np.matmul(a, b, out=c)
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def isolated(seconds: float, threads: int | None) -> float:
    """:func:`matmul_peak_gflops` measured in a child process that exits after it."""
    code = (
        "from ringtrain_bench.peak import matmul_peak_gflops as f; "
        f"print(f(seconds={seconds!r}, threads={threads!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    )
    return float(out.stdout.split()[-1])


def cpu_model() -> str:
    """/proc/cpuinfo's model name: the same bench reads 3x apart on two 2-core machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU model unknown"


def machine() -> dict:
    """The CPU model and the engine's kernel set that ran (``native.describe``: forced by
    ``RINGTRAIN_KERNELS`` or the widest), for a bench line: a ratio means little without both
    (issue 39: AVX2-only and AVX-512 CPUs differ by up to 2x per model)."""
    k = native.kernels
    return {
        "cpu_model": cpu_model(),
        "kernels": k.isa() if k is not None else "numpy",
        "kernels_described": native.describe(),
    }
