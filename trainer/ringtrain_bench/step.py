"""`ringtrain bench step`: training samples/s of the emulated IPU, side by side with PyTorch
and TensorFlow.

Every side runs the same model, batch, dtype (float32), optimizer and thread count, interleaved
repeat by repeat (the order rotating) so that a noisy neighbour slows all alike; the medians are
reported. The IPU side runs the trainer's real step (data gather, weight stream, forward,
backward, per-layer optimizer through the reducer), on synthetic data so the benchmark needs no
data set. ``--baseline torch`` (the default) is the presets' CNN written in PyTorch, in this
process; ``--baseline tensorflow`` is the same Keras model, from the same weights, trained by a
compiled ``tf.function`` in a child process (:mod:`ringtrain_bench.baseline_tf` says why).
Also reported: each side's GFLOP/s (the model's FLOPs per step over its time) against numpy's
float32 matmul peak with the same thread count, measured once per repeat beside the sides
(the best kept), and which BLAS kernels ran (threadpoolctl), because OpenBLAS environment
variables change the result (see /work/shared/notes/machine-facts.md).

``--workers N`` > 1 is :mod:`ringtrain_bench.step_workers`: N real worker processes (this
module with the hidden ``--child`` flag) time the same steps with communication overlapped,
serialized after backward and skipped, and report what overlap hides and what scaling costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from threadpoolctl import threadpool_info

from ringtrain.errors import InvalidSpec, RingtrainError
from ringtrain_bench import peak as peak_mod
from ringtrain_bench import step_numerics, step_workers
from ringtrain_bench.baseline_tf import TensorFlowSide
from ringtrain_bench.baseline_torch import TorchSide
from ringtrain_bench.ipu_side import IPUSide
from ringtrain_trainer.engine import native
from ringtrain_trainer.ipu.device import blas_limits, resolve_host_threads

BASELINES = ("torch", "tensorflow")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain bench step", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--model",
        default="cnn",
        metavar="NAME_OR_PATH",
        help="a preset (cnn, cnn2; the PyTorch side knows these), a .json file of "
        "model.to_json() or a .keras file (the TensorFlow side runs any of them)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        choices=BASELINES,
        help="a peer timed interleaved with the emulated IPU; repeatable (default: torch)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=150, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPUs for each side: IPU host threads, torch threads, TensorFlow intra-op threads "
        "(0: all usable)",
    )
    p.add_argument("--no-torch", action="store_true", help="no PyTorch side (nor its default)")
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
    p.add_argument(
        "--numerics",
        action="store_true",
        help="fp32 vs fp16 step time and gradient accumulation K=1 vs K=4 allreduce time per "
        "sample (ringtrain_bench.step_numerics)",
    )
    p.add_argument("--numerics-child", action="store_true", help=argparse.SUPPRESS)
    return p


def blas_info() -> list[dict]:
    keys = ("user_api", "internal_api", "num_threads", "version", "architecture")
    return [{k: i.get(k) for k in keys} for i in threadpool_info()]


def baselines_of(args) -> list[str]:
    """``--baseline`` as given, else PyTorch unless ``--no-torch`` (the command's old default)."""
    if args.baseline:
        return [b for b in dict.fromkeys(args.baseline) if not (args.no_torch and b == "torch")]
    return [] if args.no_torch else ["torch"]


def make_side(name: str, args, threads: int, ipu: IPUSide, explicit: bool):
    """The baseline ``name``, or None where PyTorch is missing and nobody asked for it."""
    if name == "tensorflow":
        return TensorFlowSide(args, threads, ipu)
    try:
        return TorchSide(args, threads, ipu)
    except ImportError:
        if explicit:
            raise InvalidSpec("--baseline torch: PyTorch is not installed") from None
        return None


def side_report(
    side, times: list[float], cpus: list[float], args, flops_per_step: int, peak: float
) -> dict:
    """One side's figures from its block times (the median block; every block listed), and
    its CPU time per step (the least of the blocks: every thread of the side's process), the
    figure a loaded, shared machine disturbs least."""
    t = statistics.median(times)
    sps = args.batch_size * args.steps / t
    gflops = flops_per_step * args.steps / t / 1e9
    return {
        "samples_per_s": round(sps, 1),
        "gflops": round(gflops, 2),
        "percent_of_peak": round(100 * gflops / peak, 2),
        "loss_first": side.loss_first,
        "loss_last": side.loss_last,
        "block_seconds": [round(x, 4) for x in times],
        "cpu_ms_per_step": round(1e3 * min(cpus) / args.steps, 4),
    }


def bench_one_worker(args) -> dict:
    """Every side gets ``threads`` CPUs: PyTorch as intra-op threads, TensorFlow as intra-op
    threads with one inter-op thread, the emulated IPU as host threads (shards) with
    single-threaded BLAS, as ``ringtrain worker`` runs it. GFLOP/s count the model's FLOPs
    (the IPU's per-step count) for every side, so they compare like samples/s do."""
    threads = args.threads = resolve_host_threads(args.threads)
    sides: list = []
    try:
        with blas_limits(threads):
            ipu = IPUSide(args)
            sides.append(ipu)
            for name in baselines_of(args):
                side = make_side(name, args, threads, ipu, bool(args.baseline))
                if side is not None:
                    sides.append(side)
            for side in sides:
                side.run(args.warmup)
            times: list[list[float]] = [[] for _ in sides]
            cpus: list[list[float]] = [[] for _ in sides]
            peaks, order = [], []
            for r in range(args.repeats):
                # the order rotates, so no side always runs right after another
                for i in [(r + k) % len(sides) for k in range(len(sides))]:
                    times[i].append(sides[i].run(args.steps))
                    cpus[i].append(sides[i].cpu_seconds)
                    order.append(sides[i].name)
                peaks.append(peak_mod.isolated(seconds=0.1, threads=threads))
            info = blas_info()
    finally:
        for side in sides:
            side.close()
    peak = max(peaks)
    medians = [statistics.median(t) for t in times]
    ours = side_report(ipu, times[0], cpus[0], args, ipu.flops_per_step, peak)
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "threads": threads,
        **peak_mod.machine(),
        "steps": args.steps,
        "repeats": args.repeats,
        **ours,
        "start_loss": ipu.start_loss,
        "torch_samples_per_s": None,
        "ratio_vs_torch": None,
        "matmul_peak_gflops": round(peak, 1),
        "matmul_peak_threads": threads,
        "block_order": order,
        "blas": info,
        "openblas_env": {
            k: os.environ.get(k)
            for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")
        },
        "baselines": {},
    }
    for side, block_times, cpu, t in zip(sides[1:], times[1:], cpus[1:], medians[1:], strict=True):
        theirs = side_report(side, block_times, cpu, args, ipu.flops_per_step, peak)
        # the ratio of the unrounded rates: ringtrain / baseline
        ratio = round(t / medians[0], 3)
        result["baselines"][side.name] = {
            **theirs,
            "ratio": ratio,
            # the same, by CPU time per step: their CPU ms / ours
            "cpu_ratio": round(theirs["cpu_ms_per_step"] / ours["cpu_ms_per_step"], 3),
            "version": side.version,
            "start_loss": side.start_loss,
            # same model, same weights: the same loss on ringtrain's first batch (training
            # mode; Dropout would make it differ by chance)
            "same_start": side.start_loss is not None
            and ipu.start_loss is not None
            and abs(side.start_loss - ipu.start_loss) <= 1e-4 * max(1.0, abs(ipu.start_loss)),
            **(
                {
                    "runtime": side.info,
                    "weights_moved": side.weights_moved,
                    "tf_function_traces": side.traces,
                }
                if side.name == "tensorflow"
                else {}
            ),
        }
        result[f"{side.name}_samples_per_s"] = theirs["samples_per_s"]
        result[f"ratio_vs_{side.name}"] = ratio
        result[f"cpu_ratio_vs_{side.name}"] = result["baselines"][side.name]["cpu_ratio"]
        result[f"{side.name}_version"] = side.version
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # the edge: before any model compiles (a worker child's config checks it again)
        native.force(os.environ.get(native.ENV, ""))
    except InvalidSpec as e:
        print(f"ringtrain bench step: {e}", file=sys.stderr)
        return e.exit_code
    if args.child:
        print(json.dumps(step_workers.child(args)), flush=True)
        return 0
    if args.numerics_child:
        print(json.dumps(step_numerics.child(args)), flush=True)
        return 0
    if args.numerics:
        result = step_numerics.bench(args)
        if not args.json:
            acc = result["accumulation"]
            print(
                f"ms per step: fp32 {result['step_ms']['fp32']}, fp16 {result['step_ms']['fp16']}"
                f"; allreduce per sample ({acc['workers']} workers): K=1 "
                f"{acc['K=1']['allreduce_us_per_sample']} us, K=4 "
                f"{acc['K=4']['allreduce_us_per_sample']} us\n# {result['note']}"
            )
        else:
            print(json.dumps(result))
        return 0
    try:
        if args.workers < 1 or args.batch_size < 1 or args.steps < 1 or args.repeats < 1:
            raise InvalidSpec("--workers, --batch-size, --steps and --repeats must be positive")
        if args.workers > 1 and args.baseline:
            raise InvalidSpec("--baseline compares one worker's step; leave it out with --workers")
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
        print(
            f"numpy float32 matmul peak {result['matmul_peak_gflops']} GFLOP/s "
            f"({result['threads']} threads)"
        )
        for name, b in [("emulated IPU", result), *result["baselines"].items()]:
            print(
                f"{name + ':':13} {b['samples_per_s']:,.0f} samples/s, {b['gflops']} GFLOP/s "
                f"({b['percent_of_peak']} % of peak)"
                + (f", ringtrain / {name} {b['ratio']}" if "ratio" in b else "")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
