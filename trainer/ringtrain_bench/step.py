"""`ringtrain bench step`: training samples/s of the emulated IPU, side by side with PyTorch.

Both run the same model, batch, dtype (float32), optimizer (Adam) and thread count in the same
process, interleaved repeat by repeat so that a noisy neighbour slows both alike; the medians
are reported. The IPU side runs the trainer's real step (data gather, weight stream, forward,
backward, per-layer optimizer through the reducer), on synthetic data so the benchmark needs no
data set. Also reported: achieved GFLOP/s against numpy's float32 matmul peak measured in the
same run, and which BLAS kernels ran (threadpoolctl), because OpenBLAS environment variables
change the result (see /work/shared/notes/machine-facts.md).

``--workers N`` > 1 is :mod:`ringtrain_bench.step_workers`: N real worker processes (this
module with the hidden ``--child`` flag) time the same steps with communication overlapped,
serialized after backward and skipped, and report what overlap hides and what scaling costs.
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

from ringtrain.errors import InvalidSpec, RingtrainError
from ringtrain_trainer import data as data_mod
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu import blas_limits, resolve_host_threads
from ringtrain_trainer.reducer import StepCommStats
from ringtrain_trainer.worker import Trainer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain bench step", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--model",
        default="cnn",
        metavar="NAME_OR_PATH",
        help="a preset (cnn, cnn2; the PyTorch side knows these), a .json file of "
        "model.to_json() or a .keras file",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=150, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPUs for each side: torch threads, IPU host threads (0: all usable)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    p.add_argument(
        "--transport",
        default="grpc+tcp",
        choices=("grpc+tcp", "grpc+shm", "grpc", "tcp"),
        help="ring data path with --workers > 1: grpc+tcp with shared memory off (as "
        "between pods), grpc+shm (as between processes of one host), grpc; "
        "tcp: old name of grpc+tcp",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def synthetic(n: int, seed: int = 0) -> data_mod.Dataset:
    rng = np.random.default_rng(seed)
    split = data_mod.Split(  # stands in for Fashion-MNIST, so it is fed as x / 255 too
        rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n),
        data_mod.BUILTIN_SCALE,
    )
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

    def __init__(
        self, args, collective: Collective | None = None, cfg: TrainerConfig | None = None
    ):
        self.batch = args.batch_size
        cfg = cfg or TrainerConfig()
        cfg = dataclasses.replace(
            cfg,
            dataset="synthetic",
            model=args.model,
            batch_size=args.batch_size,
            steps=10**9,
            ipu_host_threads=args.threads,
        )
        self.trainer = Trainer(
            cfg,
            collective or LocalCollective(),
            synthetic(max(8192, 4 * self.batch)),
            out=io.StringIO(),
        )
        self.flops_per_step = self.trainer.exe.flops_per_run
        self.comm = StepCommStats()

    def run(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            _, _, c = self.trainer.train_one_step()
            self.comm = self.comm + c
        return time.perf_counter() - t

    def close(self):
        self.trainer.close()


class TorchSide:
    """The same model and step in PyTorch (CPU, float32, Adam with Keras' epsilon)."""

    def __init__(self, args, threads: int):
        import torch
        from torch import nn

        if args.model not in ("cnn", "cnn2"):
            raise InvalidSpec(
                f"--model {args.model}: the PyTorch side has only the presets "
                "cnn and cnn2; add --no-torch"
            )
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
        "model": args.model,
        "batch_size": args.batch_size,
        "threads": threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "samples_per_s": round(sps, 1),
        "torch_samples_per_s": None,
        "ratio_vs_torch": None,
        "gflops": round(ipu.flops_per_step * args.steps / t_ours / 1e9, 2),
        "matmul_peak_gflops": round(peak, 1),
        "blas": info,
        "openblas_env": {
            k: os.environ.get(k)
            for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")
        },
    }
    if theirs:
        tsps = args.batch_size * args.steps / statistics.median(theirs)
        result["torch_samples_per_s"] = round(tsps, 1)
        result["ratio_vs_torch"] = round(sps / tsps, 3)
        result["torch_version"] = torch_side.torch.__version__
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ringtrain_bench import step_workers

    if args.child:
        print(json.dumps(step_workers.child(args)), flush=True)
        return 0
    try:
        if args.workers < 1 or args.batch_size < 1 or args.steps < 1 or args.repeats < 1:
            raise InvalidSpec("--workers, --batch-size, --steps and --repeats must be positive")
        if args.workers > 1:
            result = step_workers.bench_step_workers(args)
            if not args.json:
                v = result["variants"]
                hidden = result["hidden_fraction"]
                print(
                    f"{args.workers} workers, ms per step: overlapped "
                    f"{v['overlapped']['step_ms']}, serialized {v['serialized']['step_ms']}, "
                    f"no communication {v['no_comm']['step_ms']}; exposed communication "
                    f"{result['exposed_comm_ms_per_step']} ms, hidden "
                    f"{'n/a' if hidden is None else f'{hidden:.0%}'}, "
                    f"{result['global_samples_per_s']:,.0f} samples/s, scaling efficiency "
                    f"{result['scaling_efficiency']}\n# {result['note']}"
                )
        else:
            result = bench_one_worker(args)
    except RingtrainError as e:
        print(f"ringtrain bench step: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(result))
    elif args.workers == 1:
        t = result.get("torch_samples_per_s")
        print(
            f"emulated IPU: {result['samples_per_s']:,.0f} samples/s "
            f"({result['gflops']} GFLOP/s, numpy matmul peak {result['matmul_peak_gflops']})"
        )
        if t:
            print(f"PyTorch:      {t:,.0f} samples/s   ratio {result['ratio_vs_torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
