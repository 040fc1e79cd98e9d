"""`ringtrain bench allreduce`: the ring's bandwidth next to gloo and Open MPI, in one run.

Starts N local processes per implementation (the ring over each requested data path —
``grpc+tcp`` with shared memory off, as between pods, and ``grpc+shm``, as between processes of
one host —, torch.distributed's gloo, mpi4py under ``mpirun``), times ``--iters`` allreduces
per size after a barrier each, and reports the median with nccl-tests' definitions: algbw = S/t and
busbw = 2(N-1)/N · S/t, plus the median CPU time of rank 0's process per allreduce (``cpu_s``,
all threads), which stays meaningful when other work shares the cores. The ring computes the
*mean* in place; gloo is measured twice, as ``gloo-sum`` (its native operation, a plain
in-place sum) and ``gloo-mean`` (sum, then divide, the ring's own work), and MPI sums then
divides. Ratio lines compare each ring path with ``gloo-sum`` — the stricter peer, since it
does less work than the ring — and with ``mpi``. ``--rounds`` repeats the whole comparison
interleaved, so that a change in machine load hits every implementation alike. On a 2-core
machine N > 2 processes share the cores: such figures measure the transport, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ringtrain import pki
from ringtrain.cluster import ClusterSpec
from ringtrain_bench.allreduce_figures import MIB, OPS, environment, ratios, summarize
from ringtrain_bench.procs import SHM_VIA, free_ports, new_token, run_processes
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.mpi import connect as mpi_connect
from ringtrain_trainer.ring import connect
from ringtrain_trainer.ring.engine import RingCollective
from ringtrain_trainer.ring.malloc_tuning import tune as tune_malloc
from ringtrain_trainer.ring.schedule import DEFAULT_CHUNK_BYTES


class GlooCollective(Collective):
    """torch.distributed's gloo backend as a Collective (benchmark baseline only). With
    ``divide=False`` "mean" is gloo's plain sum: the baseline without the division's pass."""

    def __init__(self, rank: int, size: int, port: int, divide: bool = True) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._divide = divide
        self.rank, self.size = rank, size
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )

    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        import torch

        self._dist.all_reduce(torch.from_numpy(buf))
        if self._divide:
            np.divide(buf, self.size, out=buf)

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        import torch

        self._dist.broadcast(torch.from_numpy(buf), src=root)

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        self._dist.destroy_process_group()


#: An implementation name's suffix for the ring under the job's mutual TLS (``--tls``).
TLS_SUFFIX = "+tls"

#: What each ``--baseline`` runs: gloo both as its native plain sum and as sum-then-divide.
BASELINES = {"gloo": ("gloo-sum", "gloo-mean"), "mpi": ("mpi",)}


def _child_collective(
    impl: str, rank: int, workers: int, ports: list[int], chunk_kib: int, malloc_tuning: bool = True
) -> Collective:
    if impl in ("gloo-sum", "gloo-mean"):
        return GlooCollective(rank, workers, ports[0], divide=impl == "gloo-mean")
    if impl == "mpi":
        return mpi_connect()
    if malloc_tuning:  # as the worker does
        tune_malloc()

    spec = ClusterSpec(cluster={"worker": tuple(f"127.0.0.1:{p}" for p in ports)}, task_index=rank)
    path = impl.removeprefix("ring-")
    secure = path.endswith(TLS_SUFFIX)
    path = path.removesuffix(TLS_SUFFIX)
    coll = connect(
        spec,
        os.environ["RINGTRAIN_TOKEN"].encode(),
        transport=SHM_VIA.get(path, path),
        connect_timeout_s=60,
        chunk_bytes=chunk_kib * 1024,
        tls=pki.load(os.environ["RINGTRAIN_TLS_DIR"]) if secure else None,
        encrypt_data=secure,
        shared_memory=path in SHM_VIA,
    )
    runs = coll.transport.name if isinstance(coll, RingCollective) else "no ring"
    if runs != path:  # the label must name what runs
        coll.close()
        raise RuntimeError(f"{impl}: the ring runs {runs}")
    return coll


def child(
    impl: str,
    rank: int,
    workers: int,
    ports: list[int],
    sizes_mib: list[float],
    iters: int,
    warmup: int,
    chunk_kib: int,
    malloc_tuning: bool = True,
) -> None:
    """One benchmark process: prints (rank 0 only) one JSON line of times per size."""
    coll = _child_collective(impl, rank, workers, ports, chunk_kib, malloc_tuning)
    rank = coll.rank
    try:
        for size in sizes_mib:
            buf = np.ones(max(1, int(size * MIB) // 4), np.float32)
            times, cpu = [], []
            for i in range(warmup + iters):
                coll.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                coll.allreduce_mean_(buf, step=i)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if i >= warmup:
                    times.append(dt)
                    cpu.append(dc)
            want = 1.0 if OPS.get(impl, "mean") == "mean" else float(workers) ** (warmup + iters)
            if want < 1e38 and not np.allclose(buf[:1], want):  # sums of sums of ones
                raise AssertionError(f"{impl}: {OPS.get(impl, 'mean')} of ones is {buf[0]}")
            if rank == 0:
                print(json.dumps({"size_mib": size, "times_s": times, "cpu_s": cpu}), flush=True)
    finally:
        coll.close()


def run_impl(
    impl: str,
    workers: int,
    sizes_mib: list[float],
    iters: int,
    warmup: int,
    chunk_kib: int,
    timeout_s: float,
    malloc_tuning: bool = True,
) -> dict[float, dict]:
    """Start the processes of one implementation; rank 0's raw timings per size."""
    ports = free_ports(workers)
    env = dict(os.environ, RINGTRAIN_TOKEN=new_token())
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-tls-") as tls_dir:
        if impl.endswith(TLS_SUFFIX):
            for name, content in pki.create("bench", "default", "bench").files().items():
                Path(tls_dir, name).write_bytes(content)
            env["RINGTRAIN_TLS_DIR"] = tls_dir
        return _run_impl(
            impl, workers, sizes_mib, iters, warmup, chunk_kib, timeout_s, ports, env, malloc_tuning
        )


def _run_impl(
    impl: str,
    workers: int,
    sizes_mib: list[float],
    iters: int,
    warmup: int,
    chunk_kib: int,
    timeout_s: float,
    ports: list[int],
    env: dict,
    malloc_tuning: bool = True,
) -> dict[float, dict]:
    args = [
        "--child",
        impl,
        "--workers",
        str(workers),
        "--ports",
        ",".join(map(str, ports)),
        "--size-mib",
        *map(str, sizes_mib),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        "--chunk-kib",
        str(chunk_kib),
        *([] if malloc_tuning else ["--no-malloc-tuning"]),
    ]
    me = [sys.executable, "-m", "ringtrain_bench.allreduce"]
    if impl == "mpi":
        cmds = [
            [
                "mpirun",
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                str(workers),
                *me,
                *args,
                "--rank",
                "-1",
            ]
        ]
    else:
        cmds = [[*me, *args, "--rank", str(r)] for r in range(workers)]
    docs = run_processes(f"bench {impl}", cmds, [env] * len(cmds), timeout_s)
    return {d["size_mib"]: d for d in docs}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ringtrain bench allreduce", description=__doc__)
    p.add_argument("--workers", type=int, default=2, help="local processes (default 2)")
    p.add_argument(
        "--size-mib", type=float, nargs="+", default=[64.0], help="buffer sizes in MiB (default 64)"
    )
    p.add_argument("--iters", type=int, default=11, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole comparison, interleaved (medians over all rounds)",
    )
    p.add_argument(
        "--chunk-kib",
        type=int,
        default=DEFAULT_CHUNK_BYTES // 1024,
        help="ring chunk size in KiB (default %(default)s)",
    )
    p.add_argument(
        "--transport",
        action="append",
        choices=["grpc+tcp", "grpc+shm", "grpc", "tcp"],
        help="ring data path(s) to measure (repeatable; default grpc+tcp and "
        "grpc+shm: the side channel with shared memory off, as between pods, "
        "and on, as between processes of one host; tcp: old name of grpc+tcp)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="also measure each ring data path under the job's mutual TLS (grpc+tcp: "
        "--ring-encrypt-data), labelled ring-<path>+tls",
    )
    p.add_argument(
        "--baseline",
        action="append",
        choices=["gloo", "mpi"],
        default=[],
        help="also measure torch.distributed gloo (as gloo-sum, its plain sum, and "
        "gloo-mean, sum then divide; ratios against gloo-sum) / mpi4py "
        "(repeatable)",
    )
    p.add_argument(
        "--no-malloc-tuning",
        dest="malloc_tuning",
        action="store_false",
        help="leave glibc malloc's defaults in the ring processes (the worker "
        "tunes it; see ringtrain_trainer.ring.malloc_tuning)",
    )
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(
            a.child,
            a.rank,
            a.workers,
            [int(x) for x in a.ports.split(",")],
            a.size_mib,
            a.iters,
            a.warmup,
            a.chunk_kib,
            a.malloc_tuning,
        )
        return 0
    if a.workers < 2:
        p.error("--workers must be at least 2 (one process has nothing to reduce)")
    rings = [
        f"ring-{ {'tcp': 'grpc+tcp'}.get(t, t) }" for t in (a.transport or ["grpc+tcp", "grpc+shm"])
    ]
    if a.tls:
        rings = [
            v
            for r in rings
            for v in (r, r + TLS_SUFFIX)
            if not (v.endswith(TLS_SUFFIX) and r.removeprefix("ring-") in SHM_VIA)
        ]
    impls = rings + [b for name in dict.fromkeys(a.baseline) for b in BASELINES[name]]
    load_before = os.getloadavg()[0]
    times: dict[tuple[str, float], tuple[list, list]] = {}
    for _ in range(a.rounds):  # interleaved, so a change in machine load hits every impl
        for impl in impls:
            got = run_impl(
                impl,
                a.workers,
                a.size_mib,
                a.iters,
                a.warmup,
                a.chunk_kib,
                a.timeout_s,
                a.malloc_tuning,
            )
            for size, doc in got.items():
                t, c = times.setdefault((impl, size), ([], []))
                t += doc["times_s"]
                c += doc["cpu_s"]
    rows = [
        summarize(impl, a.workers, size, t, c, a.chunk_kib)
        for (impl, size), (t, c) in times.items()
    ]
    rows += ratios(rows)
    env = environment(load_before, a.malloc_tuning)
    print(
        json.dumps(env)
        if a.json
        else f"# {env['cpus']} CPUs, load {env['load_before']:.1f} -> {env['load_after']:.1f}, "
        f"numpy {env['numpy']}, grpcio {env['grpcio']}"
    )
    for row in rows:
        if a.json:
            print(json.dumps(row))
        elif row["bench"] == "allreduce":
            print(
                f"{row['impl']:>9} N={row['workers']} {row['size_mib']:>8g} MiB  "
                f"median {row['median_s'] * 1e3:9.3f} ms  algbw {row['algbw_gbps']:6.2f} GB/s"
                f"  busbw {row['busbw_gbps']:6.2f} GB/s  cpu {row['cpu_s'] * 1e3:8.2f} ms"
            )
        else:
            print(
                f"{row['impl']:>9} vs {row['baseline']:<5} N={row['workers']} "
                f"{row['size_mib']:>8g} MiB  busbw x{row['busbw_ratio']:.2f}  "
                f"time x{row['time_ratio']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
