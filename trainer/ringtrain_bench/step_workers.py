"""`ringtrain bench step --workers N`: what overlapping communication with backward buys.

One run starts N real worker processes on loopback (``python -m ringtrain_bench.step --child``
through ``ringtrain_bench.procs``, as ``ringtrain run`` starts them: TF_CONFIG and the job's
token in the environment, the worker's own ``connect``). Each process builds the trainer's
step three times over and times the same steps in three variants, interleaved repeat by
repeat (the order rotating) so that a drift in the machine's load hits all three alike:

- ``overlapped``: today's reducer, each bucket reduced while backward goes on;
- ``serialized``: the reducer with ``overlap=False`` (``ringtrain worker --no-overlap-comm``),
  every bucket held until backward ends, then reduced and applied;
- ``no_comm``: the same pipeline (buckets, communication thread, optimizer hook) with a no-op
  collective, i.e. the same N processes with the same threads each, training concurrently
  without a ring. That is "one worker on the same CPU share": each worker competes for the
  machine exactly as a ring worker does, and is not one worker alone with every CPU.

The figures, and why: the wall-clock step of the slowest worker per repeat (the step is
synchronous) is what a job gets, so the comparison is made there and not on self-reported
intervals, which cannot see the CPU the communication thread takes from backward, nor tell
waiting for a slower peer from useful overlap. See :data:`DEFINITIONS`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from ringtrain_bench import procs
from ringtrain_bench.ipu_side import IPUSide
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.device import blas_limits, resolve_host_threads
from ringtrain_trainer.reducer import StepCommStats
from ringtrain_trainer.ring.engine import RingCollective
from ringtrain_trainer.worker_main import connect as worker_connect

VARIANTS = ("overlapped", "serialized", "no_comm")

#: Printed into the JSON so that each figure carries its meaning.
DEFINITIONS = {
    "step_ms": "median over repeats of the slowest worker's time per step (the step is "
    "synchronous); for no_comm, whose workers are not in lockstep and each step for "
    "the same wall-clock window, N / the workers' summed steps per second",
    "exposed_comm_ms_per_step": "step_ms(overlapped) - step_ms(no_comm): what communication "
    "still costs each step, the CPU its thread takes included",
    "hidden_fraction": "(step_ms(serialized) - step_ms(overlapped)) / (step_ms(serialized) - "
    "step_ms(no_comm)): the share of serialized communication's cost that "
    "overlap removes; 0 without overlap; may leave [0, 1] by noise",
    "scaling_efficiency": "global samples/s (overlapped) / the N workers' summed no_comm "
    "samples/s: the same N processes, same threads each, running "
    "concurrently with a no-op collective for the same wall-clock window "
    "(the same CPU share)",
    "reducer_overlap_fraction": "the live metric ringtrain_allreduce_overlap_ratio over the "
    "overlapped run: allreduce time during this worker's backward "
    "and not blocked on a peer / allreduce time",
    "lead_ms_per_step": "how long before backward ended the step's first allreduce started "
    "(0 when serialized, by construction)",
}

#: Said next to every multi-worker step figure (see /work/shared/notes/machine-facts.md).
STEP_NOTE = (
    "{n} worker processes on one machine with {cpus} CPUs ({fits}): the baseline is "
    "the same {n} processes without communication, so the figures measure the ring "
    "and its overlap with backward on this CPU share, not scaling across machines"
)


class NoCommCollective(Collective):
    """The ring's rank and size with a no-op allreduce: the reducer runs as on the ring (its
    thread, buckets, hook) but nothing is communicated. Barriers and broadcasts still go to
    ``ring`` so that the variants line up."""

    def __init__(self, ring: Collective):
        self.ring, self.rank, self.size = ring, ring.rank, ring.size

    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        pass

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        self.ring.broadcast_(buf, root)

    def barrier(self) -> None:
        self.ring.barrier()


def child(args) -> dict:
    """One worker: the three variants' trainers on one ring, warm-up, then per repeat each
    variant's steps after a barrier. The end checks that the ring variants' replicas still
    agree (rank 0's weights broadcast and compared)."""
    path = {"tcp": "grpc+tcp"}.get(args.transport, args.transport)
    cfg = TrainerConfig.from_args(
        [
            "--ring-transport",
            procs.SHM_VIA.get(path, path),
            "--termination-log",
            "",
            *([] if path in procs.SHM_VIA else ["--no-ring-shared-memory"]),
        ]
    )
    ring = worker_connect(cfg)
    runs = ring.transport.name if isinstance(ring, RingCollective) else "no ring"
    if runs != path:  # the figures must name the data path that ran
        ring.close()
        raise RuntimeError(f"bench step: asked for {path}, the ring runs {runs}")
    try:
        with blas_limits(args.threads):
            sides = {
                "overlapped": IPUSide(args, ring, cfg),
                "serialized": IPUSide(args, ring, cfg.replace(overlap_comm=False)),
                "no_comm": IPUSide(args, NoCommCollective(ring), cfg),
            }
            for side in sides.values():
                side.run(args.warmup)
                side.comm = StepCommStats()
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            window = np.zeros(1, np.float32)
            counted = dict.fromkeys(VARIANTS, 0)
            for r in range(args.repeats):
                for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                    if v == "no_comm":  # as long as rank 0's last overlapped run
                        window[0] = times["overlapped"][-1] if times["overlapped"] else 0
                        ring.broadcast_(window, root=0)
                    ring.barrier()
                    if v == "no_comm":
                        t, done = run_window(sides[v], args.steps, float(window[0]))
                    else:
                        t, done = sides[v].run(args.steps), args.steps
                    times[v].append(t)
                    counted[v] += done
            diff = 0.0
            for v in ("overlapped", "serialized"):
                params = sides[v].trainer.params
                ref = params.copy()
                ring.broadcast_(ref, root=0)
                diff = max(diff, float(np.max(np.abs(ref - params))))
            for side in sides.values():
                side.close()
    finally:
        ring.close()
    return {
        "rank": ring.rank,
        "world_size": ring.size,
        "times_s": times,
        "comm": {v: dataclasses.asdict(s.comm) for v, s in sides.items()},
        "steps_timed": counted,
        "max_param_diff": diff,
    }


def run_window(side: IPUSide, steps: int, seconds: float) -> tuple[float, int]:
    """Steps for ``seconds`` (``steps`` if 0); returns the time ``steps`` took at the rate
    achieved, and the steps run. The no-comm workers are not in lockstep: with a fixed step count
    the faster would finish first and leave the slower the machine, so each runs for the same
    window and every worker competes for the CPU the whole time, as on the ring."""
    if seconds <= 0:
        return side.run(steps), steps
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        side.run(1)
        done += 1
    return (time.perf_counter() - t0) * steps / done, done


def ms(x: float) -> float:
    return round(x * 1e3, 3)


def bench_step_workers(args) -> dict:
    """Start the N workers, collect their times and turn them into the figures of
    :data:`DEFINITIONS`, the three variants side by side."""
    n = args.workers
    cpus = resolve_host_threads(0)
    threads = args.threads or max(1, cpus // n)
    load_before = os.getloadavg()[0]
    cmd = [
        sys.executable,
        "-m",
        "ringtrain_bench.step",
        "--child",
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(threads),
        "--transport",
        args.transport,
    ]
    envs = procs.member_envs(
        procs.without_cluster(), procs.loopback_addresses(n), procs.new_token()
    )
    docs = procs.run_processes(f"bench step ({n} workers)", [cmd] * n, envs, 900)
    if sorted(d["rank"] for d in docs) != list(range(n)):
        raise RuntimeError(f"bench step: expected ranks 0..{n - 1}, got {docs}")
    steps = args.steps
    variants, step_s = {}, {}
    for v in VARIANTS:
        if v == "no_comm":  # not in lockstep: N steps at the workers' summed rate
            per_step = [
                n / sum(steps / d["times_s"][v][i] for d in docs) for i in range(args.repeats)
            ]
        else:  # the synchronous step lasts as long as its slowest worker
            per_step = [max(d["times_s"][v][i] for d in docs) / steps for i in range(args.repeats)]
        step_s[v] = statistics.median(per_step)
        per_worker = [args.batch_size * steps / statistics.median(d["times_s"][v]) for d in docs]
        c = {k: sum(d["comm"][v][k] for d in docs) for k in docs[0]["comm"][v]}
        timed = sum(d["steps_timed"][v] for d in docs)
        variants[v] = {
            "step_ms": ms(step_s[v]),
            "global_samples_per_s": round(n * args.batch_size / step_s[v], 1),
            "samples_per_s_per_worker": [round(x, 1) for x in per_worker],
            "allreduce_ms_per_step": ms(c["allreduce_s"] / timed),
            "reducer_hidden_ms_per_step": ms(c["hidden_s"] / timed),
            "peer_wait_ms_per_step": ms(c["peer_wait_s"] / timed),
            "exposed_wait_ms_per_step": ms(c["exposed_wait_s"] / timed),
            "lead_ms_per_step": ms(c["lead_s"] / timed),
            "reducer_overlap_fraction": round(c["hidden_s"] / c["allreduce_s"], 3)
            if c["allreduce_s"] > 0
            else 0.0,
        }
    # the figures derived from step times use the step_ms printed, so the JSON recomputes exactly
    ov, ser, none = (variants[v]["step_ms"] / 1e3 for v in VARIANTS)
    return {
        "bench": "step",
        "workers": n,
        "model": args.model,
        "batch_size": args.batch_size,
        "global_batch": n * args.batch_size,
        "threads_per_worker": threads,
        "cpus": cpus,
        "transport": {"tcp": "grpc+tcp"}.get(args.transport, args.transport),
        "steps": args.steps,
        "repeats": args.repeats,
        "exposed_comm_ms_per_step": ms(ov - none),
        "hidden_fraction": round((ser - ov) / (ser - none), 3) if ser > none else None,
        "scaling_efficiency": round(none / ov, 3),
        "global_samples_per_s": variants["overlapped"]["global_samples_per_s"],
        "samples_per_s_per_worker": variants["overlapped"]["samples_per_s_per_worker"],
        "reducer_overlap_fraction": variants["overlapped"]["reducer_overlap_fraction"],
        "variants": variants,
        "max_param_diff": max(d["max_param_diff"] for d in docs),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "definitions": DEFINITIONS,
        "note": STEP_NOTE.format(
            n=n,
            cpus=cpus,
            fits="a core each" if n * threads <= cpus else "fewer cores than threads",
        ),
    }
