"""One ring member for the multi-process tests: a real process on loopback running a scenario.

Run as ``python ring_worker.py SCENARIO --rank R --addresses A,B,... [--transport T]`` with the
token in RINGTRAIN_TOKEN and, for mutual TLS, the job's material in RINGTRAIN_TLS_DIR. Prints
one JSON line per event; exits with the trainer's exit code of any error so tests can check the
retryable code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from ringtrain import pki
from ringtrain.cluster import ClusterSpec
from ringtrain.errors import RingtrainError, exit_code_for
from ringtrain_trainer.ring import connect


def pattern(n: int, rank: int) -> np.ndarray:
    """Rank-specific values whose sums are exact in float32, so the mean has one right answer."""
    return (((np.arange(n, dtype=np.int64) * 7 + rank * 13) % 101) - 50).astype(np.float32)


def expected_mean(n: int, world: int) -> np.ndarray:
    return sum(pattern(n, r).astype(np.float64) for r in range(world)) / world


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def check_allreduce(coll, sizes: list[int], world: int, rank: int, step: int) -> None:
    for tag, n in enumerate(sizes):
        buf = pattern(n, rank)
        coll.allreduce_mean_(buf, step=step, tag=tag)
        want = expected_mean(n, world)
        if not np.allclose(buf, want, rtol=1e-6, atol=1e-6):
            bad = int(np.argmax(np.abs(buf - want)))
            raise AssertionError(
                f"rank {rank} size {n}: element {bad} is {buf[bad]}, want {want[bad]}"
            )


def check_broadcast(coll, n: int, world: int, rank: int) -> None:
    for root in range(world):
        buf = pattern(n, rank)
        coll.broadcast_(buf, root=root)
        if not np.array_equal(buf, pattern(n, root)):
            raise AssertionError(f"rank {rank}: broadcast from {root} of {n} differs")


def worker_sequence(coll, sizes: list[int], world: int, rank: int, steps: int) -> None:
    """The collectives of ``ringtrain worker`` in its order: the weights, optimizer state and
    counters broadcast from rank 0 as the *first* collectives of the ring (so no send call has
    been opened before: the rank whose right neighbour is the root only receives, ranks
    1..N-2 receive and forward), then per step one allreduce per gradient bucket, the
    evaluation's allreduce (tag -2) and a barrier."""
    params_n = sizes[-1]
    for i, n in enumerate([params_n, params_n, params_n, 4]):  # params, adam m and v, counters
        buf = pattern(n, rank) + i
        coll.broadcast_(buf, root=0)
        if not np.array_equal(buf, pattern(n, 0) + i):
            raise AssertionError(f"rank {rank}: broadcast {i} of {n} floats from 0 differs")
    for step in range(steps):
        check_allreduce(coll, sizes, world, rank, step=step)
    counts = np.array([rank + 1], np.float32)
    coll.allreduce_mean_(counts, step=steps, tag=-2)
    if counts[0] * world != sum(range(1, world + 1)):
        raise AssertionError(f"rank {rank}: evaluation count {counts[0] * world}")
    coll.barrier()


def ring_metrics(coll, world: int, rank: int, n: int) -> None:
    """The trainer's ``ringtrain_ring_*`` metrics on an injected registry: 3 allreduces of
    ``n`` floats, a barrier and a broadcast from rank 0; then rank 1 leaves and rank 0's next
    allreduce breaks the ring. Emits the samples (rank 0 after the failure)."""
    from prometheus_client import CollectorRegistry

    from ringtrain.errors import RingError
    from ringtrain_trainer.telemetry.metrics import TrainerMetrics

    registry = CollectorRegistry()
    TrainerMetrics(registry=registry).watch_ring(coll)
    for step in range(3):
        coll.allreduce_mean_(pattern(n, rank), step=step)
    coll.barrier()
    coll.broadcast_(pattern(n, rank), root=0)
    if rank == 0:
        try:
            coll.allreduce_mean_(pattern(n, rank), step=3)
        except RingError as e:
            emit(event="broke", rank=rank, type=type(e).__name__)
    t = coll.transport.name

    def sample(name: str, **labels) -> float | None:
        return registry.get_sample_value(name, dict(labels, transport=t))

    labels = sorted(
        {
            s.labels["transport"]
            for fam in registry.collect()
            if fam.name.startswith("ringtrain_ring_")
            for s in fam.samples
            if "transport" in s.labels
        }
    )
    emit(
        event="metrics",
        rank=rank,
        transport=t,
        labels=labels,
        sent=sample("ringtrain_ring_bytes_total", direction="sent"),
        received=sample("ringtrain_ring_bytes_total", direction="received"),
        allreduces=sample("ringtrain_ring_allreduce_seconds_count"),
        allreduce_s=sample("ringtrain_ring_allreduce_seconds_sum"),
        errors={
            k: sample("ringtrain_ring_errors_total", kind=k)
            for k in ("timeout", "link", "interrupted")
        },
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["allreduce", "pause", "loop", "rss", "worker", "metrics"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--addresses", required=True)
    p.add_argument("--transport", default="grpc+tcp")
    p.add_argument("--encrypt-data", action="store_true")
    p.add_argument("--sizes", default="0,1,2,3,5,1000,262147")
    p.add_argument("--chunk-bytes", type=int, default=4096)
    p.add_argument("--step-timeout-s", type=float, default=20.0)
    p.add_argument("--connect-timeout-s", type=float, default=20.0)
    p.add_argument("--ops", type=int, default=1000, help="collectives in the rss scenario")
    p.add_argument("--steps", type=int, default=3, help="training steps in the worker scenario")
    p.add_argument("--health-timeout-s", type=float, default=3.0)
    p.add_argument("--health-port", type=int, default=0)
    p.add_argument("--stall-s", type=float, default=60.0)
    p.add_argument("--min-bytes-per-s", type=float, default=1 << 20)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the trainer's /metrics and /status, fed by the ring",
    )
    a = p.parse_args(argv)
    addresses = a.addresses.split(",")
    spec = ClusterSpec(cluster={"worker": tuple(addresses)}, task_index=a.rank)
    world, rank = len(addresses), a.rank
    sizes = [int(s) for s in a.sizes.split(",")]
    coll = server = observer = None
    if a.metrics_port:
        from ringtrain_trainer.telemetry.metrics import RingMetrics, TrainerMetrics
        from ringtrain_trainer.telemetry.server import MetricsServer

        metrics = TrainerMetrics()
        server = MetricsServer(metrics, a.metrics_port)
        observer = RingMetrics(metrics)
    try:
        # grpc+shm is grpc+tcp with shared memory on; grpc+tcp here means with it off
        coll = connect(
            spec,
            os.environ["RINGTRAIN_TOKEN"].encode(),
            transport="grpc+tcp" if a.transport == "grpc+shm" else a.transport,
            shared_memory=a.transport == "grpc+shm",
            chunk_bytes=a.chunk_bytes,
            step_timeout_s=a.step_timeout_s,
            connect_timeout_s=a.connect_timeout_s,
            health_timeout_s=a.health_timeout_s,
            stall_s=a.stall_s,
            min_bytes_per_s=a.min_bytes_per_s,
            observer=observer,
            encrypt_data=a.encrypt_data,
            health_port=a.health_port,
            tls=pki.load(os.environ["RINGTRAIN_TLS_DIR"])
            if os.environ.get("RINGTRAIN_TLS_DIR")
            else None,
        )
        want = {"tcp": "grpc+tcp"}.get(a.transport, a.transport)
        if world > 1 and coll.transport.name != want and not a.encrypt_data:
            raise AssertionError(f"asked for {want}, the ring runs {coll.transport.name}")
        if a.scenario == "allreduce":
            check_allreduce(coll, sizes, world, rank, step=1)
            check_broadcast(coll, sizes[-1], world, rank)
            coll.barrier()
            check_allreduce(coll, sizes[::-1], world, rank, step=2)
        elif a.scenario == "worker":
            worker_sequence(coll, sizes, world, rank, a.steps)
        elif a.scenario == "metrics":
            ring_metrics(coll, world, rank, sizes[-1])
        elif a.scenario == "pause":
            check_allreduce(coll, sizes, world, rank, step=1)
            emit(event="ready", rank=rank, data_port=getattr(coll.control, "data_port", None))
            if rank == 1:
                sys.stdin.readline()
            check_allreduce(coll, sizes, world, rank, step=2)
        elif a.scenario == "rss":
            import resource

            buf = pattern(sizes[-1], rank)
            for step in range(a.ops):
                if step == 100:
                    rss_100 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                coll.allreduce_mean_(buf, step=step)
            rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            emit(event="rss", rank=rank, kib_at_100=rss_100, kib_at_end=rss_end)
        else:
            step = 0
            while True:
                check_allreduce(coll, sizes, world, rank, step=step)
                if step == 0:
                    emit(event="started", rank=rank)
                step += 1
        emit(event="done", rank=rank, refused=getattr(coll, "refused", None))
        return 0
    except RingtrainError as e:
        emit(
            event="error",
            rank=rank,
            type=type(e).__name__,
            message=str(e),
            exit_code=exit_code_for(e),
        )
        return exit_code_for(e)
    finally:
        if coll is not None:
            coll.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
