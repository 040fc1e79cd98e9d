"""The allreduce benchmark's figures: a result row with nccl-tests' algbw and busbw, the ratios
of each ring row to the peer measured at the same size (gloo's plain sum, MPI), and what the
figures depend on (cores, load, versions).

Apart from ``allreduce`` (which starts and times the processes) so the definitions a reader
checks a figure against are in one short place.
"""

from __future__ import annotations

import os
import statistics
import sys

import grpc
import numpy as np

MIB = 1 << 20
#: The baselines the ring is compared with (gloo's plain sum is the stricter of gloo's two).
RATIO_BASELINES = ("gloo-sum", "mpi")
#: What an implementation computes: the ring's mean or a plain sum.
OPS = {"gloo-sum": "sum"}


def summarize(
    impl: str, workers: int, size_mib: float, times: list[float], cpu: list[float], chunk_kib: int
) -> dict:
    """One result row with nccl-tests' algbw and busbw from the median time."""
    med = statistics.median(times)
    algbw = size_mib * MIB / med / 1e9
    return {
        "bench": "allreduce",
        "impl": impl,
        "op": OPS.get(impl, "mean"),
        "workers": workers,
        "size_mib": size_mib,
        "iters": len(times),
        "median_s": med,
        "min_s": min(times),
        "cpu_s": statistics.median(cpu),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (workers - 1) / workers,
        "chunk_kib": chunk_kib if impl.startswith("ring-") else None,
    }


def environment(load_before: float, malloc_tuning: bool = True) -> dict:
    """What the figures depend on: cores, machine load around the run, library versions, and
    whether the ring processes tuned glibc malloc."""
    return {
        "bench": "allreduce-env",
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "malloc_tuning": malloc_tuning,
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "python": sys.version.split()[0],
    }


def ratios(rows: list[dict], baselines: tuple[str, ...] = RATIO_BASELINES) -> list[dict]:
    """busbw ratio and latency ratio of each ring row against each of ``baselines`` measured
    at the same size (gloo's plain sum and MPI by default)."""
    out = []
    for r in rows:
        if not r["impl"].startswith("ring-"):
            continue
        for b in rows:
            if b["impl"] in baselines and b["size_mib"] == r["size_mib"]:
                out.append(
                    {
                        "bench": "allreduce-ratio",
                        "impl": r["impl"],
                        "baseline": b["impl"],
                        "baseline_op": b["op"],
                        "workers": r["workers"],
                        "size_mib": r["size_mib"],
                        "busbw_ratio": r["busbw_gbps"] / b["busbw_gbps"],
                        "time_ratio": r["median_s"] / b["median_s"],
                    }
                )
    return out
