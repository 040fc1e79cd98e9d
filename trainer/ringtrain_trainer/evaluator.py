"""`ringtrain worker` as TF_CONFIG's ``evaluator``: TensorFlow's sidecar evaluator.

Pipeline position: beside the ring, never in it. ``worker_main.main`` hands a process whose
TF_CONFIG task type is ``evaluator`` to :func:`run`. It watches the checkpoint directory the
chief writes, evaluates every new checkpoint on the whole test split (loss and accuracy, one
:class:`ringtrain.events.Evaluation` each — on stdout, ``/status`` and ``/metrics``) and exits
0 once the chief has finished and the last checkpoint is evaluated.

How it knows the chief finished: after its final checkpoint (and the export, if any) the chief
writes :data:`DONE_FILE` into the checkpoint directory, atomically, holding its
:class:`~ringtrain.events.Final`. The evaluator ends once it has evaluated a checkpoint of that
step. A chief that starts training removes a stale marker first (a resumed run with more
steps). The chief writes no marker when it is stopped (SIGTERM): the evaluator keeps waiting for
the gang the operator starts next, or is stopped with the job.

A checkpoint pruned (``--checkpoint-keep``) before the evaluator reached it is skipped, as
TensorFlow's evaluator skips the checkpoints it did not see; the newest is never pruned, so the
last one is always evaluated. The forward pass runs on the host with the trainer's own compiled
:class:`~.engine.model.Program` (TensorFlow's evaluator typically runs on a CPU too).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import numpy as np

from ringtrain import events, files
from ringtrain.errors import CheckpointError, InvalidSpec
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.npz import fit_model
from ringtrain_trainer.engine import keras_metrics
from ringtrain_trainer.engine import model as model_mod
from ringtrain_trainer.engine.multiloss import MultiLossSpec, make_loss
from ringtrain_trainer.ipu.device import EVAL_BATCH
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.keras.load import describe
from ringtrain_trainer.telemetry import tensorboard
from ringtrain_trainer.telemetry.metrics import TrainerMetrics

#: The chief's "training finished" marker in the checkpoint directory (its Final event, JSON).
DONE_FILE = "training-done.json"
#: Seconds between looks at the checkpoint directory: a checkpoint takes far longer to train.
POLL_S = 1.0


def write_done(checkpoint_dir: str | os.PathLike, final: events.Final) -> Path:
    """The chief, after its last checkpoint: training finished (atomically: tmp + rename)."""
    path = Path(checkpoint_dir) / DONE_FILE
    return files.atomic_write(path, (final.to_json() + "\n").encode())


def clear_done(checkpoint_dir: str | os.PathLike) -> None:
    """The chief, before training: a marker of an earlier run no longer holds."""
    (Path(checkpoint_dir) / DONE_FILE).unlink(missing_ok=True)


#: a done marker is one Final event; anything larger is not one (never read whole)
MAX_DONE_BYTES = 1 << 20
#: the refused markers already named on stderr (the evaluator looks every ``POLL_S``)
_refused: set[str] = set()


def read_done(checkpoint_dir: str | os.PathLike) -> events.Final | None:
    """The chief's marker, or None: absent, or not one — too large, a symbolic link or a FIFO
    is refused unread (``files.read_regular``) and named on stderr once."""
    path = Path(checkpoint_dir) / DONE_FILE
    try:
        doc = json.loads(files.read_regular(path, MAX_DONE_BYTES, "done marker"))
    except files.Refused as e:
        if os.path.lexists(path) and str(e) not in _refused:
            _refused.add(str(e))
            print(f"ringtrain evaluator: {e}", file=sys.stderr, flush=True)
        return None
    except (ValueError, RecursionError, OSError):  # torn JSON cannot happen; EIO can
        return None
    event = events.parse(doc)
    return event if isinstance(event, events.Final) else None


def cross_entropy(outputs: np.ndarray, labels: np.ndarray, from_logits: bool = True) -> float:
    """Sparse categorical cross-entropy summed over the rows, in float64."""
    z = outputs.astype(np.float64)
    picked = z[np.arange(len(labels)), labels]
    if from_logits:
        m = z.max(axis=1)
        return float(np.sum(m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - picked))
    return float(-np.sum(np.log(np.clip(picked, 1e-7, 1.0))))


class Evaluator:
    """Evaluates checkpoints of one directory as they appear; :meth:`run` returns the Final."""

    def __init__(
        self,
        cfg: TrainerConfig,
        metrics: TrainerMetrics | None = None,
        out: TextIO | None = None,
        dataset: data_mod.Dataset | None = None,
        poll_s: float = POLL_S,
    ):
        if not cfg.checkpoint_dir:
            raise InvalidSpec(
                "an evaluator (TF_CONFIG task type evaluator) needs "
                "--checkpoint-dir: the directory the chief writes checkpoints to"
            )
        self.cfg, self.poll_s = cfg, poll_s
        self.metrics = metrics if metrics is not None else TrainerMetrics()
        self.out = out if out is not None else sys.stdout
        data = dataset if dataset is not None else data_mod.load(cfg.dataset, cfg.data_dir)
        self.spec = keras_load.build(cfg.model, lambda _: tuple(data.train.images.shape[1:]))
        self.data, note = fit_model(data, self.spec, cfg.data_dir if dataset is None else data.name)
        if note:
            print(f"ringtrain evaluator: note: {note}", file=sys.stderr)
        self.batch = min(EVAL_BATCH, max(1, len(self.data.test)))
        self.program = model_mod.Program(self.spec, self.batch, train=False)
        #: the model's loss (``engine.losses``), evaluated in float64
        self.loss = make_loss(self.spec.loss, self.batch, self.spec.num_classes, np.float64)
        self.compiled = keras_metrics.for_model(self.spec)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir)
        self.stop_requested = threading.Event()
        self.evaluated: list[events.Evaluation] = []
        self.outputs: events.Values | None = None
        self.tb = tensorboard.EvalWriter(
            tensorboard.log_dir(cfg.tensorboard_dir, cfg.checkpoint_dir, "evaluator")
        )

    def emit(self, event: events.Event) -> None:
        line = event.to_json() if self.cfg.json else events.format_event(event)
        print(line, file=self.out, flush=True)

    def evaluate(self, state: TrainingState) -> tuple[float, float]:
        """(mean loss, the loss's metric: accuracy, or MAE for regression) of ``state``'s
        parameters *and* non-trainable state (the moving statistics) on the whole test split,
        fed as training fed it (``Split.scale``)."""
        if state.model != self.cfg.model or state.params.shape != (self.spec.num_params,):
            raise CheckpointError(
                f"checkpoint of model {describe(state.model)} "
                f"({state.params.size} params) cannot be evaluated as "
                f"--model {describe(self.cfg.model)}"
            )
        np.copyto(self.program.state, self.ckpt.require_model_state(state, self.spec))
        views = self.spec.views(np.asarray(state.params, self.program.dtype))
        images, labels = self.data.test.images, self.data.test.labels
        scale = self.program.dtype.type(self.data.test.scale)
        lossfn = self.loss
        self.compiled = keras_metrics.for_model(self.spec)
        multi = self.spec.loss if isinstance(self.spec.loss, MultiLossSpec) else None
        sums = np.zeros(2 * len(multi.trained)) if multi is not None and multi.trained else None
        loss = 0.0
        correct = 0.0
        x = self.program.x
        for s in range(0, len(labels), self.batch):
            n = min(self.batch, len(labels) - s)
            np.multiply(images[s : s + n].reshape((n, *self.spec.input_shape)), scale, out=x[:n])
            out = self.program.forward(views)[:n]
            loss += lossfn.total(out, labels[s : s + n])
            correct += lossfn.score(out, labels[s : s + n])
            self.compiled.update(out, labels[s : s + n])
            if sums is not None:
                sums += [
                    *lossfn.totals(out, labels[s : s + n]),
                    *lossfn.scores(out, labels[s : s + n]),
                ]
        count = max(1, len(labels))
        #: a model with several outputs: this evaluation's loss and metric per output
        self.outputs = (
            None if multi is None or sums is None else multi.named_eval(sums, len(labels))
        )
        # Keras' test loss includes the weight regularizers' penalty, as its training loss
        return loss / count + self.spec.penalty(state.params), correct / count

    def _new_checkpoints(self) -> list[Path]:
        last = self.evaluated[-1].step if self.evaluated else None
        if last is None:
            last = -1
        return [m for m in self.ckpt.manifests() if int(m.stem.split("-")[1]) > last]

    def evaluate_new(self) -> None:
        """Every checkpoint newer than the last one evaluated, oldest first."""
        for manifest in self._new_checkpoints():
            try:
                state = self.ckpt.load(manifest)
            except CheckpointError as e:
                if manifest.exists():  # corrupt, not merely pruned meanwhile
                    print(f"ringtrain evaluator: skipping checkpoint: {e}", file=sys.stderr)
                continue
            loss, acc = self.evaluate(state)
            metric = self.spec.loss.metric
            mae = metric == "mae"
            extra = self.compiled.results() or None
            ev = events.Evaluation(
                step=state.step,
                test_loss=round(loss, 6),
                test_accuracy=None if mae else round(acc, 6),
                checkpoint=str(manifest),
                test_mae=round(acc, 6) if mae else None,
                test_metrics=extra,
                outputs=self.outputs,
            )
            self.evaluated.append(ev)
            self.metrics.observe_evaluation(state.step, loss, acc, metric)
            self.metrics.update_status(test_metrics=extra)
            self.tb.evaluation(state.step, loss, acc, metric, extra)
            if self.outputs and self.tb.on:
                self.tb.scalars(state.step, {f"eval/test_{k}": v for k, v in self.outputs.items()})
            if self.outputs:
                self.metrics.update_status(test_outputs=self.outputs)
            self.emit(ev)

    def run(self) -> events.Final:
        """Evaluate until the chief's marker names a step evaluated (or a stop is asked)."""
        self.metrics.update_status(phase="Evaluating")
        while True:
            done = read_done(self.ckpt.dir)  # before the scan: its checkpoint is already there
            self.evaluate_new()
            last = self.evaluated[-1].step if self.evaluated else None
            if done is not None and (done.steps is None or (last or 0) >= done.steps):
                break
            if self.stop_requested.wait(self.poll_s):
                break
        terminated = self.stop_requested.is_set()
        last_ev = self.evaluated[-1] if self.evaluated else None
        final = events.Final(
            steps=last_ev.step if last_ev else None,
            test_accuracy=last_ev.test_accuracy if last_ev else None,
            checkpoint=last_ev.checkpoint if last_ev else None,
            terminated=terminated,
            test_loss=last_ev.test_loss if last_ev else None,
            evaluations=len(self.evaluated),
            test_mae=last_ev.test_mae if last_ev else None,
        )
        self.metrics.update_status(phase="Terminated" if terminated else "Succeeded")
        self.tb.close()
        self.emit(final)
        return final


def run(
    cfg: TrainerConfig,
    metrics: TrainerMetrics,
    install_signals: Callable[[threading.Event], Callable[[], None]],
) -> events.Final:
    """The evaluator's process: ``install_signals`` makes SIGTERM set the stop event."""
    evaluator = Evaluator(cfg, metrics)
    restore = install_signals(evaluator.stop_requested)
    try:
        return evaluator.run()
    finally:
        restore()
