"""The machine's matmul peak, the denominator of every "% of peak" the benches print.

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

import numpy as np
from threadpoolctl import threadpool_limits


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
