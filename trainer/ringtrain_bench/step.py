"""`ringtrain bench step`: training samples/s of the emulated IPU, side by side with PyTorch.

Both run the same model, batch, dtype (float32), optimizer (Adam) and thread count in the same
process, interleaved repeat by repeat so that a noisy neighbour slows both alike; the medians
are reported. The IPU side runs the trainer's real step (data gather, weight stream, forward,
backward, per-layer optimizer through the reducer), on synthetic data so the benchmark needs no
data set. Also reported: achieved GFLOP/s against numpy's float32 matmul peak measured in the
same run, and which BLAS kernels ran (threadpoolctl), because OpenBLAS environment variables
change the result (see /work/shared/notes/machine-facts.md).

``--workers N`` > 1 (:func:`bench_step_workers`) starts this module once per worker with the
hidden ``--child`` flag through ``ringtrain_bench.procs``, as ``ringtrain run`` would:
:func:`child` is one real ``ringtrain worker``-style process (TF_CONFIG and token from its
environment, the worker's own ``connect``) that times the same step loop and reports its
communication statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import sys
import time

import numpy as np

from ringtrain_trainer import data as data_mod
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain.errors import InvalidSpec, RingtrainError
from ringtrain_trainer.ipu import blas_limits, resolve_host_threads
from ringtrain_trainer.reducer import StepCommStats
from ringtrain_trainer.worker import Trainer
from ringtrain_trainer.worker import connect as worker_connect
from ringtrain_bench import procs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain bench step", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--model", default="cnn", metavar="NAME_OR_PATH",
                   help="a preset (cnn, cnn2; the PyTorch side knows these), a .json file of "
                        "model.to_json() or a .keras file")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=150, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0,
                   help="CPUs for each side: torch threads, IPU host threads (0: all usable)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    p.add_argument("--transport", default="grpc+tcp", choices=("grpc+tcp", "grpc", "tcp"),
                   help="ring data path with --workers > 1 (tcp: old name of grpc+tcp)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def synthetic(n: int, seed: int = 0) -> data_mod.Dataset:
    rng = np.random.default_rng(seed)
    split = data_mod.Split(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                           rng.integers(0, 10, n))
    return data_mod.Dataset("synthetic", split, split)


def matmul_peak_gflops(n: int = 512, seconds: float = 0.3) -> float:
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b, c = a.copy(), np.empty_like(a)
    np.matmul(a, b, out=c)
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


class IPUSide:
    """The trainer's own step loop on synthetic data, alone or as one worker of a ring.

    ``comm`` accumulates the reducer's per-step statistics over every timed step, so that a
    ring worker can report how much allreduce time backward hid."""

    def __init__(self, args, collective: Collective | None = None,
                 cfg: TrainerConfig | None = None):
        self.batch = args.batch_size
        cfg = cfg or TrainerConfig()
        cfg = dataclasses.replace(cfg, dataset="synthetic", model=args.model,
                                  batch_size=args.batch_size, steps=10**9,
                                  ipu_host_threads=args.threads)
        self.trainer = Trainer(cfg, collective or LocalCollective(),
                               synthetic(max(8192, 4 * self.batch)), out=io.StringIO())
        self.flops_per_step = self.trainer.exe.flops_per_run
        self.comm = StepCommStats()

    def run(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            _, _, c = self.trainer.train_one_step()
            self.comm = StepCommStats(self.comm.allreduce_s + c.allreduce_s,
                                      self.comm.hidden_s + c.hidden_s,
                                      self.comm.exposed_wait_s + c.exposed_wait_s,
                                      self.comm.bytes + c.bytes)
        return time.perf_counter() - t

    def close(self):
        self.trainer.close()


class TorchSide:
    """The same model and step in PyTorch (CPU, float32, Adam with Keras' epsilon)."""

    def __init__(self, args, threads: int):
        import torch
        from torch import nn

        if args.model not in ("cnn", "cnn2"):
            raise InvalidSpec(f"--model {args.model}: the PyTorch side has only the presets "
                              "cnn and cnn2; add --no-torch")
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        layers = [nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2)]
        flat = 13 * 13 * 32
        if args.model == "cnn2":
            layers += [nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2)]
            flat = 5 * 5 * 64
        layers += [nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, 10)]
        self.model = nn.Sequential(*layers)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, eps=1e-7)
        self.loss = nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(0)
        n = max(8192, 4 * args.batch_size)
        self.x = torch.rand(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.batch, self.n, self.pos = args.batch_size, n, 0

    def run(self, steps: int) -> float:
        torch = self.torch
        t = time.perf_counter()
        for _ in range(steps):
            if self.pos + self.batch > self.n:
                self.pos = 0
            idx = torch.arange(self.pos, self.pos + self.batch)
            self.pos += self.batch
            xb, yb = self.x[idx], self.y[idx]
            self.opt.zero_grad(set_to_none=True)
            self.loss(self.model(xb), yb).backward()
            self.opt.step()
        return time.perf_counter() - t


def blas_info() -> list[dict]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keys = ("user_api", "internal_api", "num_threads", "version", "architecture")
    return [{k: i.get(k) for k in keys} for i in threadpool_info()]


def bench_one_worker(args) -> dict:
    """Both sides get ``threads`` CPUs: PyTorch as intra-op threads, the emulated IPU as host
    threads (shards) with single-threaded BLAS, as ``ringtrain worker`` runs it."""
    threads = args.threads = resolve_host_threads(args.threads)
    with blas_limits(threads):
        ipu = IPUSide(args)
        torch_side = None
        if not args.no_torch:
            try:
                torch_side = TorchSide(args, threads)
            except ImportError:
                torch_side = None
        ipu.run(args.warmup)
        if torch_side:
            torch_side.run(args.warmup)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(ipu.run(args.steps))
            if torch_side:
                theirs.append(torch_side.run(args.steps))
        ipu.close()
        info = blas_info()
    peak = matmul_peak_gflops()  # numpy's own BLAS threads: the machine's matmul peak
    t_ours = statistics.median(ours)
    sps = args.batch_size * args.steps / t_ours
    result = {
        "model": args.model, "batch_size": args.batch_size, "threads": threads,
        "steps": args.steps, "repeats": args.repeats,
        "samples_per_s": round(sps, 1),
        "torch_samples_per_s": None, "ratio_vs_torch": None,
        "gflops": round(ipu.flops_per_step * args.steps / t_ours / 1e9, 2),
        "matmul_peak_gflops": round(peak, 1),
        "blas": info,
        "openblas_env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                          "OPENBLAS_NUM_THREADS")},
    }
    if theirs:
        tsps = args.batch_size * args.steps / statistics.median(theirs)
        result["torch_samples_per_s"] = round(tsps, 1)
        result["ratio_vs_torch"] = round(sps / tsps, 3)
        result["torch_version"] = torch_side.torch.__version__
    return result


def child(args) -> dict:
    """One worker of ``bench step --workers N`` (started by :func:`bench_step_workers`).

    The ring comes from TF_CONFIG and RINGTRAIN_TOKEN in the environment through the worker's
    own flag parsing and ``connect`` (no TF_CONFIG: a single worker, the baseline). After the
    warm-up a barrier lines the workers up so every repeat times the same synchronous steps.
    The end checks the replicas still agree: rank 0's weights are broadcast and compared."""
    cfg = TrainerConfig.from_args(["--ring-transport", args.transport, "--termination-log", ""])
    collective = worker_connect(cfg)
    try:
        with blas_limits(args.threads):
            side = IPUSide(args, collective, cfg)
            side.run(args.warmup)
            collective.barrier()
            side.comm = StepCommStats()
            times = [side.run(args.steps) for _ in range(args.repeats)]
            params = side.trainer.params
            ref = params.copy()
            collective.broadcast_(ref, root=0)
            side.close()
    finally:
        collective.close()
    c = side.comm
    return {"rank": collective.rank, "world_size": collective.size, "times_s": times,
            "allreduce_s": c.allreduce_s, "hidden_s": c.hidden_s,
            "exposed_wait_s": c.exposed_wait_s,
            "max_param_diff": float(np.max(np.abs(ref - params)))}


#: Said next to every multi-worker step figure (see /work/shared/notes/machine-facts.md).
STEP_NOTE = ("{n} worker processes on one machine with {cpus} CPUs: the figures measure the ring "
             "transport and the overlap of allreduce with backward; scaling efficiency is "
             "against one worker with the same threads in the same run and only means scaling "
             "when every worker has cores of its own ({fits})")


def bench_step_workers(args) -> dict:
    """``ringtrain bench step --workers N``: N real worker processes on loopback over the ring.

    One worker alone (the baseline, same model, batch and threads; run before and after), and
    between those N workers, each a ``python -m ringtrain_bench.step --child`` process with its own TF_CONFIG and the job's
    token, as ``ringtrain run`` starts them. Per-worker samples/s come from each worker's
    median repeat; global samples/s from the slowest worker per repeat (the step is
    synchronous); ``overlap_fraction`` is the allreduce time hidden behind backward over every
    timed step of every worker, as the reducer measures it."""
    n = args.workers
    cpus = resolve_host_threads(0)
    threads = args.threads or max(1, cpus // n)
    load_before = os.getloadavg()[0]
    base = [sys.executable, "-m", "ringtrain_bench.step", "--child", "--model", args.model,
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--threads", str(threads), "--transport", args.transport]
    env = procs.without_cluster()
    timeout_s = 600

    def alone() -> list[float]:
        (doc,) = procs.run_processes("bench step (1 worker)", [base], [env], timeout_s)
        return doc["times_s"]

    single_times = alone()  # before and after the ring, so a drift in load hits both sides
    envs = procs.member_envs(env, procs.loopback_addresses(n), procs.new_token())
    docs = procs.run_processes(f"bench step ({n} workers)", [base] * n, envs, timeout_s)
    if sorted(d["rank"] for d in docs) != list(range(n)):
        raise RuntimeError(f"bench step: expected ranks 0..{n - 1}, got {docs}")
    single_times += alone()
    samples = args.batch_size * args.steps
    per_worker = [samples / statistics.median(d["times_s"]) for d in docs]
    slowest = [max(d["times_s"][i] for d in docs) for i in range(args.repeats)]
    global_sps = n * samples / statistics.median(slowest)
    single_sps = samples / statistics.median(single_times)
    allreduce_s = sum(d["allreduce_s"] for d in docs)
    steps_timed = n * args.steps * args.repeats
    return {
        "bench": "step", "workers": n, "model": args.model, "batch_size": args.batch_size,
        "global_batch": n * args.batch_size, "threads_per_worker": threads, "cpus": cpus,
        "transport": {"tcp": "grpc+tcp"}.get(args.transport, args.transport),
        "steps": args.steps, "repeats": args.repeats,
        "samples_per_s_per_worker": [round(x, 1) for x in per_worker],
        "global_samples_per_s": round(global_sps, 1),
        "single_worker_samples_per_s": round(single_sps, 1),
        "scaling_efficiency": round(global_sps / (n * single_sps), 3),
        "overlap_fraction": round(sum(d["hidden_s"] for d in docs) / allreduce_s, 3)
        if allreduce_s > 0 else 0.0,
        "allreduce_ms_per_step": round(allreduce_s / steps_timed * 1e3, 3),
        "exposed_wait_ms_per_step": round(
            sum(d["exposed_wait_s"] for d in docs) / steps_timed * 1e3, 3),
        "max_param_diff": max(d["max_param_diff"] for d in docs),
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "note": STEP_NOTE.format(n=n, cpus=cpus, fits="they do here" if n * threads <= cpus
                                 else "they do not here"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    try:
        if args.workers < 1 or args.batch_size < 1 or args.steps < 1 or args.repeats < 1:
            raise InvalidSpec("--workers, --batch-size, --steps and --repeats must be positive")
        if args.workers > 1:
            result = bench_step_workers(args)
            if not args.json:
                print(f"{args.workers} workers: {result['global_samples_per_s']:,.0f} samples/s "
                      f"({result['samples_per_s_per_worker']} per worker), single worker "
                      f"{result['single_worker_samples_per_s']:,.0f}, scaling efficiency "
                      f"{result['scaling_efficiency']}, allreduce hidden behind backward "
                      f"{result['overlap_fraction']:.0%}\n# {result['note']}")
        else:
            result = bench_one_worker(args)
    except RingtrainError as e:
        print(f"ringtrain bench step: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(result))
    elif args.workers == 1:
        t = result.get("torch_samples_per_s")
        print(f"emulated IPU: {result['samples_per_s']:,.0f} samples/s "
              f"({result['gflops']} GFLOP/s, numpy matmul peak {result['matmul_peak_gflops']})")
        if t:
            print(f"PyTorch:      {t:,.0f} samples/s   ratio {result['ratio_vs_torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
