"""`ringtrain bench step --numerics`: what fp16 costs per step and what gradient accumulation
saves in communication, in one run.

- fp32 vs fp16: one worker's step (the trainer's real step on synthetic data), both
  precisions interleaved repeat by repeat, medians reported. fp16 on this emulated IPU is
  float32 arithmetic on values rounded to float16 (``engine.precision`` says why), so its step
  is *slower* than fp32 by the rounding passes; a real IPU's fp16 is faster. Reported as
  measured.
- K=1 vs K=4: ``--workers`` (at least 2) real worker processes on a loopback ring, each
  running the same micro-batch with 1 and with 4 micro-batches per optimizer step; the
  allreduce time per *sample* is the ring's time per optimizer step over the global batch of
  that step (micro-batch x K x workers): the ring moves the same bytes once per K micro-batches.
"""

from __future__ import annotations

import statistics
import sys

from ringtrain_bench import procs
from ringtrain_bench.ipu_side import IPUSide
from ringtrain_bench.step_workers import worker_connect
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.device import blas_limits, resolve_host_threads
from ringtrain_trainer.reducer import StepCommStats

KS = (1, 4)


def _ms(x: float) -> float:
    return round(x * 1e3, 3)


def precision_steps(args) -> dict:
    """fp32 and fp16 ms per step of one worker, interleaved."""
    threads = resolve_host_threads(args.threads)
    args.threads = threads
    sides = {}
    times: dict[str, list[float]] = {"fp32": [], "fp16": []}
    try:
        with blas_limits(threads):
            for p in times:
                cfg = TrainerConfig().replace(precision=p)
                sides[p] = IPUSide(args, None, cfg)
                sides[p].run(args.warmup)
            for r in range(args.repeats):
                for p in ("fp32", "fp16") if r % 2 == 0 else ("fp16", "fp32"):
                    times[p].append(sides[p].run(args.steps) / args.steps)
    finally:
        for s in sides.values():
            s.close()
    return {p: _ms(statistics.median(t)) for p, t in times.items()}


def child(args) -> dict:
    """One ring member: K=1 and K=4 trainers on one ring, interleaved, comm totals kept."""
    cfg = TrainerConfig.from_args(["--termination-log", "", "--no-ring-shared-memory"])
    ring = worker_connect(cfg)
    out: dict = {"rank": ring.rank, "world_size": ring.size, "allreduce_s": {}, "steps": {}}
    out["peer_wait_s"] = {}
    try:
        with blas_limits(args.threads):
            sides = {k: IPUSide(args, ring, cfg.replace(gradient_accumulation_steps=k)) for k in KS}
            for s in sides.values():
                s.run(args.warmup)
                s.comm = StepCommStats()
            for r in range(args.repeats):
                for k in KS if r % 2 == 0 else KS[::-1]:
                    ring.barrier()
                    sides[k].run(args.steps)
            for k, s in sides.items():
                out["allreduce_s"][k] = s.comm.allreduce_s
                out["peer_wait_s"][k] = s.comm.peer_wait_s
                out["steps"][k] = args.steps * args.repeats
                s.close()
    finally:
        ring.close()
    return out


def accumulation_comm(args) -> dict:
    """Allreduce ms per optimizer step and µs per sample, K=1 vs K=4, over ``args.workers``."""
    n = max(2, args.workers)
    threads = max(1, resolve_host_threads(0) // n)
    cmd = [sys.executable, "-m", "ringtrain_bench.step", "--numerics-child", "--model", args.model]
    cmd += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    cmd += ["--threads", str(threads)]
    envs = procs.member_envs(
        procs.without_cluster(), procs.loopback_addresses(n), procs.new_token()
    )
    docs = procs.run_processes(f"bench step --numerics ({n} workers)", [cmd] * n, envs, 900)
    result = {}
    for k in KS:
        per_step = statistics.mean(d["allreduce_s"][str(k)] / d["steps"][str(k)] for d in docs)
        wait = statistics.mean(d["peer_wait_s"][str(k)] / d["steps"][str(k)] for d in docs)
        samples = args.batch_size * k * n
        result[f"K={k}"] = {
            "allreduce_ms_per_step": _ms(per_step),
            # of which blocked on a slower peer (compute imbalance, not the wire)
            "peer_wait_ms_per_step": _ms(wait),
            "global_batch": samples,
            "allreduce_us_per_sample": round(per_step / samples * 1e6, 3),
            # the ring's own time: without the wait for a slower peer's backward
            "ring_us_per_sample": round((per_step - wait) / samples * 1e6, 3),
        }
    return {"workers": n, **result}


def bench(args) -> dict:
    return {
        "bench": "step --numerics",
        "model": args.model,
        "micro_batch": args.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
        "step_ms": precision_steps(args),
        "accumulation": accumulation_comm(args),
        "note": "fp16 is float32 arithmetic on float16-rounded values here (numpy has no fast "
        "float16 matmul): its step time includes the rounding passes, not a real IPU's speed-up",
    }
