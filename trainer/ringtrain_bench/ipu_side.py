"""The ringtrain side of ``ringtrain bench step``: the emulated IPU timed on synthetic batches.

Pipeline position: ``step`` times this side against its peers (``baseline_tf``,
``baseline_torch``) on the same batches; ``step_workers`` and ``step_numerics`` reuse it.
"""

from __future__ import annotations

import io
import time

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.keras.load import PRESETS
from ringtrain_trainer.reducer import StepCommStats
from ringtrain_trainer.worker import Trainer


def data_spec(model: str):
    """What :func:`synthetic` shapes its data for: None for a preset (the 28×28 images the
    benchmark has always used), else the model's spec."""
    return None if model in PRESETS else keras_load.build(model)


def synthetic(n: int, seed: int = 0, spec=None) -> data_mod.Dataset:
    """``n`` random examples shaped for ``spec`` (None: the presets' 28×28 images, 10
    classes): uint8 values fed as ``x / 255`` (as Fashion-MNIST is) in the model's input shape,
    and labels in the form its loss reads (class ids, one-hot rows, 0/1 rows, float targets)."""
    rng = np.random.default_rng(seed)
    shape = (28, 28) if spec is None else tuple(spec.input_shape)
    k = 10 if spec is None else spec.num_classes
    kind = "sparse" if spec is None else spec.loss.kind
    if spec is not None and spec.config is not None and spec.config.multi:
        raise InvalidSpec(
            "bench step: a model with several inputs or outputs is not supported yet "
            "(its synthetic data would need one array per input and output)"
        )
    images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    #: a loss per position reads a label per timestep or pixel (as Keras takes them)
    at = () if spec is None or spec.loss.positions == 1 else spec.loss.out_shape[:-1]
    labels: np.ndarray
    if kind == "sparse":
        labels = rng.integers(0, k, (n, *at))
    elif kind == "categorical":
        labels = np.eye(k, dtype=np.float32)[rng.integers(0, k, (n, *at))]
    elif kind == "binary":
        labels = rng.integers(0, 2, (n, *at, k)).astype(np.float32)
    else:
        labels = rng.normal(0, 1, (n, *at, k)).astype(np.float32)
    split = data_mod.Split(images, labels, data_mod.BUILTIN_SCALE)
    return data_mod.Dataset("synthetic", split, split)


class IPUSide:
    """The trainer's own step loop on synthetic data, alone or as one worker of a ring.

    ``comm`` accumulates the reducer's per-step statistics over every timed step, so that a
    ring worker can report how much allreduce time backward hid."""

    name = "ipu"

    def __init__(
        self, args, collective: Collective | None = None, cfg: TrainerConfig | None = None
    ):
        self.batch = args.batch_size
        cfg = cfg or TrainerConfig()
        cfg = cfg.replace(
            dataset="synthetic",
            model=args.model,
            batch_size=args.batch_size,
            steps=10**9,
            ipu_host_threads=args.threads,
        )
        #: the model's own input shape and labels (a zoo model is no 28×28 classifier)
        self.examples = max(8192, 4 * self.batch)
        data = synthetic(self.examples, 0, data_spec(args.model))
        self.trainer = Trainer(cfg, collective or LocalCollective(), data, out=io.StringIO())
        self.flops_per_step = self.trainer.exe.flops_per_run
        self.comm = StepCommStats()
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.cpu_seconds = 0.0  # the last run()'s CPU time, every thread of its process
        #: the very first step's loss: the starting weights' loss on the first batch
        self.start_loss: float | None = None

    def first_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The batch the first step will train on (float32 as the model sees it, labels), so
        that a baseline can compute its loss there with the same starting weights."""
        t = self.trainer
        idx = t.sharder.indices(t.position.epoch, t.position.batch)
        train = t.data.train
        return train.images[idx] * np.float32(train.scale), train.labels[idx]

    def run(self, steps: int) -> float:
        if steps < 1:  # --warmup 0
            return 0.0
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss, _, c = self.trainer.train_one_step()
            self.comm = self.comm + c
            if self.start_loss is None:
                self.start_loss = float(loss)
        dt = time.perf_counter() - t
        self.cpu_seconds = time.process_time() - cpu
        self.loss_last = float(loss)
        if self.loss_first is None:
            self.loss_first = self.loss_last
        return dt

    def close(self):
        self.trainer.close()
