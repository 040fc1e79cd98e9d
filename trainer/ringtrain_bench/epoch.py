"""`ringtrain bench epoch`: one epoch of Fashion-MNIST on 2 ring workers vs TensorFlow's
MultiWorkerMirroredStrategy over loopback.

Both sides are real processes on this machine, started the way a job starts them: ringtrain's
are ``ringtrain worker`` processes with TF_CONFIG and the job's token (``ringtrain_bench.procs``,
as ``bench step --workers N`` starts its children); TensorFlow's are two
:mod:`ringtrain_bench.epoch_tf` processes with their own TF_CONFIG. Same model, data set, global
batch, optimizer (the Keras serialization ringtrain resolves from the same options), starting
weights (ringtrain's ``spec.init(seed)``, handed to Keras) and per-worker examples (the same
:class:`~ringtrain_trainer.data.dataset.Sharder`). The sides run one after the other, never at once:
running them together would make each the other's noisy neighbour on a 2-core machine, and an
epoch is too long to interleave step by step across two sets of processes.
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

from ringtrain.errors import InvalidSpec, RingtrainError
from ringtrain_bench import procs
from ringtrain_trainer import optim
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.device import resolve_host_threads
from ringtrain_trainer.keras import load as keras_load

WORKERS = 2

#: Printed into the JSON so that each figure carries its meaning.
DEFINITIONS = {
    "epoch_s": "the slowest worker's training loop, first step to last (evaluation and "
    "process start outside it); TensorFlow's includes its first step's trace",
    "samples_per_s": "global samples trained / training seconds of the slowest worker; "
    "ringtrain: every step; TensorFlow: every step after the first (whose tf.function trace "
    "and collective set-up are no training), so neither side is charged for compiling",
    "process_s": "wall time of the whole side: start, imports, data, training, evaluation",
    "ratio": "ringtrain samples_per_s / tensorflow samples_per_s",
    "test_accuracy": "the chief's accuracy on the whole test set after training",
    "final_loss": "rank 0's loss on its own last batch",
    "first_loss": "rank 0's loss on its first batch with the starting weights",
    "same_start": "the two sides' first_loss agree to 1e-4: same model, weights and examples",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain bench epoch", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="cnn", metavar="NAME_OR_PATH", help="as the worker's")
    p.add_argument("--dataset", default="fashion-mnist", help="as the worker's")
    p.add_argument("--data", default=None, metavar="PATH", help="as the worker's")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--steps", type=int, default=0, help="cap the epoch at this many steps (0: all)")
    p.add_argument(
        "--threads", type=int, default=0, help="CPUs per worker, each side (0: CPUs / workers)"
    )
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=0.001, help="learning rate, as the worker's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    return p


def worker_args(args, threads: int) -> list[str]:
    """The options both sides are built from: the ringtrain workers run them, and the
    TensorFlow side reads its model, optimizer and weights from the config they make."""
    argv = ["--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size)]
    argv += ["--optimizer", args.optimizer, "--lr", str(args.lr)]
    argv += ["--seed", str(args.seed), "--ipu-host-threads", str(threads)]
    argv += ["--data", args.data] if args.data else []
    return argv + (["--steps", str(args.steps)] if args.steps else ["--epochs", "1"])


def run_ringtrain(args, threads: int) -> dict:
    cmd = [sys.executable, "-m", "ringtrain.cli", "worker", *worker_args(args, threads)]
    cmd += ["--json", "--termination-log", "", "--eval-every", "0"]
    envs = procs.member_envs(
        procs.without_cluster(), procs.loopback_addresses(WORKERS), procs.new_token()
    )
    t = time.perf_counter()
    docs = procs.run_processes("bench epoch (ringtrain)", [cmd] * WORKERS, envs, args.timeout_s)
    process_s = time.perf_counter() - t
    finals = [d for d in docs if d.get("event") == "final"]
    if sorted(d["rank"] for d in finals) != list(range(WORKERS)) or any(
        d["terminated"] for d in finals
    ):
        raise RuntimeError(f"bench epoch: the ringtrain workers ended {finals}")
    if len({d["params_sha256"] for d in finals}) != 1:
        raise RuntimeError("bench epoch: the ringtrain replicas disagree at the end")
    steps = finals[0]["steps"]
    first = next(d for d in docs if d.get("event") == "progress" and d["step"] == 1)
    sps = min(d["samples_per_s"] for d in finals)
    return {
        "steps": steps,
        "epoch_s": round(steps * WORKERS * args.batch_size / sps, 3),
        "samples_per_s": sps,
        "test_accuracy": next(d["test_accuracy"] for d in finals if d["rank"] == 0),
        "first_loss": first["loss"],
        "final_loss": next(d["loss"] for d in finals if d["rank"] == 0),
        "process_s": round(process_s, 3),
    }


def tensorflow_setup(args, cfg: TrainerConfig, threads: int) -> tuple[dict, list[np.ndarray]]:
    """What the TensorFlow workers build, from the config the ringtrain workers run; a model
    Keras cannot run is refused here, before either side starts."""

    spec = keras_load.build(cfg.model)
    if not hasattr(spec, "keras_weights"):
        raise InvalidSpec(f"--model {args.model}: not a Keras model; TensorFlow cannot run it")
    weights = spec.keras_weights(spec.init(cfg.seed))
    source = str(args.model) if str(args.model).endswith(".keras") else None
    setup = {
        "keras_file": str(Path(source).resolve()) if source else None,
        "keras_config": None if source else spec.keras_config(),
        "optimizer": optim.for_run(cfg, spec).keras,
        "loss": spec.loss.keras(),
        "input_shape": list(spec.config.input_shape),
        "dataset": cfg.dataset,
        "data_dir": cfg.data_dir,
        "batch_size": cfg.batch_size,
        "steps": args.steps,
        "seed": cfg.seed,
        "threads": threads,
        "weights": int(sum(w.size for w in weights)),
    }
    return setup, weights


def run_tensorflow(args, setup: dict, weights: list[np.ndarray]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-epoch-") as tmp:
        np.savez(Path(tmp) / "weights.npz", *weights)
        (Path(tmp) / "setup.json").write_text(json.dumps(setup))
        env = dict(procs.without_cluster(), KERAS_BACKEND="tensorflow")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        cmd = [sys.executable, "-m", "ringtrain_bench.epoch_tf", tmp]
        # TensorFlow's own TF_CONFIG: its gRPC servers on their own free loopback ports
        envs = procs.member_envs(env, procs.loopback_addresses(WORKERS), "")
        t = time.perf_counter()
        docs = procs.run_processes(
            "bench epoch (tensorflow)", [cmd] * WORKERS, envs, args.timeout_s
        )
        process_s = time.perf_counter() - t
    if sorted(d["rank"] for d in docs) != list(range(WORKERS)):
        raise RuntimeError(f"bench epoch: the TensorFlow workers answered {docs}")
    chief = next(d for d in docs if d["rank"] == 0)
    steps = chief["steps"]
    train_s = max(d["train_s"] for d in docs)
    return {
        "steps": steps,
        "epoch_s": round(max(d["epoch_s"] for d in docs), 3),
        "samples_per_s": round((steps - 1) * WORKERS * args.batch_size / train_s, 1),
        "test_accuracy": chief["test_accuracy"],
        "first_loss": round(chief["first_loss"], 6),
        "final_loss": round(chief["loss"], 6),
        "process_s": round(process_s, 3),
        "tensorflow": chief["tensorflow"],
        "strategy": chief["strategy"],
        "intra_op_threads": chief["intra_op_threads"],
    }


def bench_epoch(args) -> dict:
    if args.batch_size < 1 or args.steps < 0 or args.steps == 1:
        raise InvalidSpec("bench epoch: --batch-size must be >= 1 and --steps 0 or >= 2")
    cpus = resolve_host_threads(0)
    threads = args.threads or max(1, cpus // WORKERS)
    cfg = TrainerConfig.from_args(worker_args(args, threads))  # refused here, before any run
    setup, weights = tensorflow_setup(args, cfg, threads)
    load_before = os.getloadavg()
    ring = run_ringtrain(args, threads)
    load_between = os.getloadavg()
    tf = run_tensorflow(args, setup, weights)
    load_after = os.getloadavg()
    if ring["steps"] != tf["steps"]:
        raise RuntimeError(f"bench epoch: ringtrain ran {ring['steps']} steps, TF {tf['steps']}")
    return {
        "bench": "epoch",
        "model": args.model,
        "dataset": args.dataset,
        "workers": WORKERS,
        "batch_size": args.batch_size,
        "global_batch": WORKERS * args.batch_size,
        "steps": ring["steps"],
        "threads_per_worker": threads,
        "cpus": cpus,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "order": "sequential: ringtrain's 2 workers, then TensorFlow's 2 (never at once)",
        "ringtrain": ring,
        "tensorflow": tf,
        "ratio": round(ring["samples_per_s"] / tf["samples_per_s"], 3),
        "accuracy_gap": round(ring["test_accuracy"] - tf["test_accuracy"], 4),
        "same_start": abs(ring["first_loss"] - tf["first_loss"]) <= 1e-4,
        "load_before": list(load_before),
        "load_between": list(load_between),
        "load_after": list(load_after),
        "definitions": DEFINITIONS,
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        doc = bench_epoch(args)
    except RingtrainError as e:
        print(f"ringtrain bench epoch: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
