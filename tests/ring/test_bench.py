"""`ringtrain bench allreduce` end to end at a tiny size: every implementation and the JSON keys."""

import json
import subprocess

import pytest
from support.procs import CLI


@pytest.mark.timeout(120)
def test_bench_reports_every_transport_and_baseline_with_ratios():
    out = subprocess.run(
        [
            *CLI,
            "bench",
            "allreduce",
            "--workers",
            "2",
            "--size-mib",
            "0.01",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
            "--transport",
            "grpc+tcp",
            "--transport",
            "grpc+shm",
            "--transport",
            "grpc",
            "--tls",
            "--baseline",
            "gloo",
            "--baseline",
            "mpi",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    results = {r["impl"]: r for r in rows if r["bench"] == "allreduce"}
    # grpc+shm has no +tls twin (encryptData is the wire's; shared memory has none), and a
    # ring row is only printed under the name of the data path that ran
    assert set(results) == {
        "ring-grpc+tcp",
        "ring-grpc+tcp+tls",
        "ring-grpc+shm",
        "ring-grpc",
        "ring-grpc+tls",
        "gloo-sum",
        "gloo-mean",
        "mpi",
    }
    assert results["gloo-sum"]["op"] == "sum"
    assert {r["op"] for i, r in results.items() if i != "gloo-sum"} == {"mean"}
    for r in results.values():
        assert r["iters"] == 3 and r["median_s"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(N-1)/N = 1 for N = 2
        assert r["algbw_gbps"] == pytest.approx(0.01 * 2**20 / r["median_s"] / 1e9)
    ratios = [r for r in rows if r["bench"] == "allreduce-ratio"]
    assert {(r["impl"], r["baseline"]) for r in ratios} == {
        (i, b)
        for i in (
            "ring-grpc+tcp",
            "ring-grpc+tcp+tls",
            "ring-grpc+shm",
            "ring-grpc",
            "ring-grpc+tls",
        )
        for b in ("gloo-sum", "mpi")
    }
    assert {r["baseline_op"] for r in ratios if r["baseline"] == "gloo-sum"} == {"sum"}
