"""`ringtrain bench step --baseline tensorflow`: the same Keras model's train step in TensorFlow.

The baseline is what a Keras user runs: the model ringtrain trains, rebuilt in Keras (a preset
or ``.json`` from ``KerasModel.keras_config()``, a ``.keras`` file loaded by Keras itself),
given ringtrain's starting weights, the optimizer from the same Keras serialization ringtrain
resolved, the same loss, batch and synthetic data, and trained by a compiled ``tf.function``
step (``jit_compile=False``, oneDNN as TensorFlow ships it) with ``threads`` intra-op threads
and one inter-op thread.

Why a child process: TensorFlow fixes its thread pools when its runtime starts
(``set_intra_op_parallelism_threads`` raises afterwards), so a process that has already run
TensorFlow — a test session, say — cannot be given the bench's thread count, and a figure
measured with another count would be reported under the wrong name. A fresh process can; it
also keeps TensorFlow's Eigen/oneDNN pools and its libraries out of the process whose numpy
and OpenBLAS are being measured. The interleaving stays with the parent: it asks for one block
of steps at a time over a pipe (``run N``) and the child times the block itself, so the pipe
is outside every figure, and idles blocked on its stdin while the other side runs.

This module imports TensorFlow only in the child (as does ``epoch_tf``, `bench epoch`'s
TensorFlow worker); nothing in the trainer imports it. The child refuses to report (exits
non-zero, the parent raises) when what would run is not what was asked: another Keras
backend, another thread count, other weights.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_bench import procs
from ringtrain_bench.ipu_side import data_spec, synthetic


class TensorFlowSide:
    """Parent end: starts the child with ringtrain's model, weights and optimizer, then
    :meth:`run` times one block of steps there. ``info`` is what the child says it runs."""

    name = "tensorflow"

    def __init__(self, args, threads: int, ipu, timeout_s: float = 300.0):
        trainer, self.timeout_s = ipu.trainer, timeout_s
        spec = trainer.spec
        if not hasattr(spec, "keras_weights"):
            raise InvalidSpec(f"--model {args.model}: not a Keras model; TensorFlow cannot run it")
        self.tmp = tempfile.TemporaryDirectory(prefix="ringtrain-bench-tf-")
        weights = spec.keras_weights(trainer.params, trainer.ipu.state)
        np.savez(Path(self.tmp.name) / "weights.npz", *weights)
        # ringtrain's first batch: the child's loss on it with the starting weights must be
        # ringtrain's first-step loss (same model, same weights), see ``start_loss``
        x0, y0 = ipu.first_batch()
        np.savez(Path(self.tmp.name) / "first_batch.npz", x=x0, y=y0)
        source = args.model if str(args.model).endswith(".keras") else None
        setup = {
            "keras_file": str(Path(source).resolve()) if source else None,
            "keras_config": None if source else spec.keras_config(),
            "optimizer": trainer.optimizer_spec.keras,
            "loss": spec.loss.keras(),
            "model": None if source else args.model,
            "input_shape": list(spec.config.input_shape),
            "batch_size": args.batch_size,
            "threads": threads,
            "examples": max(8192, 4 * args.batch_size),
        }
        (Path(self.tmp.name) / "setup.json").write_text(json.dumps(setup))
        env = procs.without_cluster()
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        env["KERAS_BACKEND"] = "tensorflow"
        self.stderr = open(Path(self.tmp.name) / "stderr.txt", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ringtrain_bench.baseline_tf", self.tmp.name],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # the pipes asked for
        self.to_child, self.from_child = stdin, stdout
        self.info = self._answer()
        want = sum(w.size for w in weights)
        if self.info.get("weights") != want or self.info.get("intra_op_threads") != threads:
            self.close()
            raise RuntimeError(
                f"bench step: the TensorFlow side runs {self.info}, not the model "
                f"with {want} weights on {threads} threads that was asked for"
            )
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.cpu_seconds = 0.0  # the last run()'s CPU time, every thread of its process
        #: the largest change of any weight since the start: that TensorFlow really trained
        self.weights_moved = 0.0
        self.traces = 0  # times the tf.function was traced (1: one graph ran throughout)
        self.version = self.info["tensorflow"]
        self.start_loss = self.info["start_loss"]

    def _answer(self) -> dict:
        """The child's next JSON line; a child that exits or stays silent for ``timeout_s``
        (TensorFlow's import and first trace included) ends the bench with its stderr."""
        ready, _, _ = select.select([self.from_child], [], [], self.timeout_s)
        if not ready:
            self.proc.kill()
        line = self.from_child.readline() if ready else ""
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            tail = self.stderr.read()[-2000:]
            self.close()
            why = "exited" if ready else f"gave no answer in {self.timeout_s:g} s, killed:"
            raise RuntimeError(
                f"bench step: the TensorFlow side {why} {self.proc.returncode}: {tail}"
            )
        return json.loads(line)

    def run(self, steps: int) -> float:
        if steps < 1:
            return 0.0
        self.to_child.write(f"run {steps}\n")
        self.to_child.flush()
        a = self._answer()
        self.loss_last, self.weights_moved = a["loss"], a["weights_moved"]
        self.traces, self.cpu_seconds = a["traces"], a["cpu_seconds"]
        if self.loss_first is None:
            self.loss_first = self.loss_last
        return a["seconds"]

    def close(self) -> None:
        """End the child (stdin closed ends its loop), its pipes and the setup files."""
        try:
            self.to_child.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.from_child.close()
        self.stderr.close()
        self.tmp.cleanup()


def _refuse(what: str) -> None:
    print(f"ringtrain bench step (TensorFlow side): {what}", file=sys.stderr)
    sys.exit(3)


def child(directory: str) -> None:
    """Build the model, then answer ``run N`` lines with one JSON line each until stdin ends."""
    setup = json.loads((Path(directory) / "setup.json").read_text())
    # the answers get their own copy of stdout; anything else printing there (a library, C
    # code writing to fd 1) goes to stderr instead of into the parent's JSON lines
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    threads = setup["threads"]
    try:
        import tensorflow as tf
    except ImportError:
        _refuse("TensorFlow is not installed (pip install 'ringtrain[test]')")
    # before anything runs: after the runtime starts these raise
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    if keras.backend.backend() != "tensorflow":
        _refuse(f"Keras runs the {keras.backend.backend()} backend, not TensorFlow")
    if setup["keras_file"]:
        model = keras.models.load_model(setup["keras_file"], compile=False)
    else:
        model = keras.models.model_from_json(json.dumps(setup["keras_config"]))
    with np.load(Path(directory) / "weights.npz") as z:
        weights = [z[f"arr_{i}"] for i in range(len(z.files))]
    model.set_weights(weights)  # raises on any shape that differs
    with np.load(Path(directory) / "first_batch.npz") as z:
        x0 = z["x"].astype(np.float32).reshape(len(z["y"]), *setup["input_shape"])
        y0 = z["y"]
    optimizer = keras.optimizers.deserialize(setup["optimizer"])
    optimizer.build(model.trainable_variables)
    # the loss ringtrain runs, as Keras serializes it (a folded softmax/sigmoid reads the
    # model's own output here, which is the same loss)
    loss_fn = keras.losses.deserialize(setup["loss"])

    data = synthetic(setup["examples"], 0, data_spec(setup["keras_file"] or setup["model"])).train
    n, b = len(data.labels), setup["batch_size"]
    x = (data.images * np.float32(data.scale)).reshape(n, *setup["input_shape"])
    batches = [
        (tf.constant(x[i : i + b]), tf.constant(data.labels[i : i + b]))
        for i in range(0, n - b + 1, b)
    ]

    @tf.function(jit_compile=False)
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    start = loss_fn(y0, model(x0, training=True))
    start_loss = float(start + tf.add_n(model.losses)) if model.losses else float(start)
    # traced here, not in the first timed block (a trace takes ~1 s: with --warmup 0 it was the
    # median of two blocks); tracing runs nothing, so the weights stay the starting ones
    train_step.get_concrete_function(*batches[0])
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    inter = tf.config.threading.get_inter_op_parallelism_threads()
    if (intra, inter) != (threads, 1):
        _refuse(f"TensorFlow runs {intra} intra-op / {inter} inter-op threads, not {threads} / 1")
    ready = {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "intra_op_threads": intra,
        "inter_op_threads": inter,
        "jit_compile": False,
        "onednn_env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "weights": int(sum(np.size(w) for w in model.get_weights())),
        "optimizer": type(optimizer).__name__,
        "start_loss": start_loss,
    }
    print(json.dumps(ready), file=answers, flush=True)
    pos = 0
    for line in sys.stdin:
        steps = int(line.split()[1])
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = train_step(*batches[pos])
            pos = (pos + 1) % len(batches)
        last = float(loss)  # inside the timing: the step has surely finished
        seconds = time.perf_counter() - t
        cpu_seconds = time.process_time() - c  # every TensorFlow thread's CPU time
        moved = max(
            float(np.abs(w - w0).max()) for w, w0 in zip(model.get_weights(), weights, strict=True)
        )
        # one trace: every block ran the same compiled graph, no retracing inside the timing
        traces = train_step.experimental_get_tracing_count()
        answer = {"seconds": seconds, "cpu_seconds": cpu_seconds, "loss": last}
        answer.update(weights_moved=moved, traces=traces)
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    child(sys.argv[1])
