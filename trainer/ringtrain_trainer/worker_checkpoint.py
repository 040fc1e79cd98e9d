"""A worker's checkpoints: the newest one that fits this run, restored by the chief and
broadcast to its peers; the state it saves; the trained model it exports.

Split out of :mod:`ringtrain_trainer.worker` because checkpointing is its own concept (which
checkpoint fits, what the chief sends, in what order, what is refused before it is written);
:class:`Trainer` mixes it in and provides the attributes it reads (``ckpt``, ``params``,
``optimizer``, ``loss_scale``, ``ipu``...).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ringtrain import events
from ringtrain.errors import CheckpointError
from ringtrain_trainer import divergence, optim, preflight, trace
from ringtrain_trainer.checkpoint.store import TrainingState
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.export.cli import export_state
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.optim import numerics
from ringtrain_trainer.telemetry.reporting import outputs_field

if TYPE_CHECKING:
    from ringtrain_trainer.checkpoint.store import CheckpointManager
    from ringtrain_trainer.collective import Collective
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.ipu.device import IPU
    from ringtrain_trainer.keras.load import KerasModel
    from ringtrain_trainer.optim.base import Optimizer
    from ringtrain_trainer.optim.loss_scale import LossScale
    from ringtrain_trainer.optim.registry import OptimizerSpec


class Checkpointing:
    """Mixin: :meth:`_restore` (and the fit test it skips misfits by), :meth:`state`,
    :meth:`save` and :meth:`export` for the :class:`~ringtrain_trainer.worker.Trainer`."""

    cfg: TrainerConfig
    collective: Collective
    ckpt: CheckpointManager | None
    is_chief: bool
    world: int
    spec: KerasModel
    params: np.ndarray
    optimizer: Optimizer
    optimizer_spec: OptimizerSpec
    loss_scale: LossScale
    ipu: IPU
    sharder: data_mod.Sharder
    step: int
    position: data_mod.Position
    rank: int
    tracer: trace.Tracer
    numerics: numerics.Numerics
    last_checkpoint: str | None
    _output_losses: Callable[[], events.Values | None]
    #: told the step training goes on from once the state is restored (an elastic job's
    #: re-formed chief reports its resize with it: ``worker_main``)
    on_restored: Callable[[int], None] | None = None

    def _restore(self) -> None:
        """Rank 0 resumes from the newest good checkpoint and broadcasts its state, so only the
        chief needs to see the checkpoint directory."""
        if self.ckpt is not None and self.is_chief:
            state, skipped = self.ckpt.load_latest(self._fits)
            for e in skipped:
                print(f"ringtrain worker: skipping corrupt checkpoint: {e}", file=sys.stderr)
            if state is not None:
                note = optim.check_resume(
                    self.optimizer_spec, self.optimizer, state, str(self.ckpt.dir)
                )
                if note:
                    print(f"ringtrain worker: {note}", file=sys.stderr, flush=True)
                np.copyto(self.params, state.params)
                self.optimizer.load_state(state.optimizer_state, state.optimizer_iterations)
                self.loss_scale.load(state.optimizer_state)
                self.ipu.load_state(self.ckpt.require_model_state(state, self.spec))
                self.step = state.step
                self.position = state.position.rescale(self.sharder.global_batch)
        if self.world > 1:
            self.collective.broadcast_(self.params, root=0)
            for buf in self.optimizer.state.values():
                self.collective.broadcast_(buf, root=0)
            ls = self.loss_scale  # powers of two and counts below 2**24: exact in float32
            counters = np.array(
                [
                    self.step,
                    self.position.epoch,
                    self.position.batch,
                    self.optimizer.iterations,
                    ls.scale,
                    ls.counter,
                ],
                np.float32,
            )
            self.collective.broadcast_(counters, root=0)
            if self.ipu.state.size:  # the chief's moving statistics (ops.batchnorm)
                self.collective.broadcast_(self.ipu.state, root=0)
                self.ipu.load_state(self.ipu.state)
            step, epoch, batch, iters = (int(v) for v in counters[:4])
            ls.scale, ls.counter = float(counters[4]), int(counters[5])
            self.step, self.optimizer.iterations = step, iters
            self.position = data_mod.Position(epoch, batch, self.sharder.global_batch)
        if self.on_restored is not None:
            self.on_restored(self.step)

    def _fits(self, state: TrainingState) -> None:
        """A CheckpointError naming the file unless ``state`` (intact: its checksum held)
        fits this run: the model, every array's shape, the optimizer. One that does not is
        skipped for the previous one, as a corrupt one is, instead of crashing in a copy."""
        where = state.source or str(self.ckpt.dir if self.ckpt else "checkpoint")
        if state.model != self.cfg.model or state.params.shape != self.params.shape:
            raise CheckpointError(
                f"{where}: checkpoint of model {keras_model.describe(state.model)} "
                f"({state.params.size} params, shape {state.params.shape}) cannot resume --model "
                f"{keras_model.describe(self.cfg.model)} ({self.params.size} params)"
            )
        for k, buf in self.optimizer.state.items():
            got = state.optimizer_state.get(k)
            if got is not None and got.shape != buf.shape:
                raise CheckpointError(
                    f"{where}: optimizer state {k!r} has shape {got.shape}, this run {buf.shape}"
                )
        optim.check_resume(self.optimizer_spec, self.optimizer, state, where)
        if self.ckpt is not None:
            self.ckpt.require_model_state(state, self.spec)

    def state(self, loss: float | None) -> TrainingState:
        return TrainingState(
            step=self.step,
            position=self.position,
            params=self.params,
            optimizer=self.optimizer.name,
            optimizer_state={**self.optimizer.state_dict(), **self.loss_scale.state()},
            optimizer_iterations=self.optimizer.iterations,
            optimizer_config=self.optimizer_spec.record(),
            # several outputs: each output's loss of the last step beside its loss function
            loss_config={**self.spec.loss.record(), **outputs_field(self._output_losses())},
            precision=self.numerics.precision,
            model=self.cfg.model,
            world_size=self.world,
            loss=loss,
            model_state=self.ipu.state,
        )

    def _where(self, step: int) -> str:
        return f"step {step} rank {self.rank}"

    def save(self, loss: float | None) -> None:
        # on every worker (the same parameters, the same verdict), before the chief writes
        divergence.check_params(
            self.spec, self.params, self._where(self.step), "checkpoint", self.ipu.state
        )
        if self.ckpt is None or not self.is_chief:
            return
        with self.tracer.span(trace.CHECKPOINT, "checkpoint"):
            path = self.ckpt.save(self.state(loss))
        self.last_checkpoint = str(path)

    def export(self, loss: float | None) -> str | None:
        """``--export``: the chief writes the trained model with ``ringtrain export``'s code; a
        relative path is under the checkpoint directory."""
        if not self.cfg.export or not self.is_chief:
            return None
        divergence.check_params(
            self.spec, self.params, self._where(self.step), "export", self.ipu.state
        )

        path = preflight.export_path(self.cfg.export, self.cfg.checkpoint_dir)
        fmt = self.cfg.export_format
        return str(export_state(self.state(loss), path, fmt, spec=self.spec))
