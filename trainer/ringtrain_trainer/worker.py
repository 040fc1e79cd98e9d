"""`ringtrain worker`: one replica's training loop.

Pipeline position: ``worker_main.main`` reads the flags, connects the collective and runs
:class:`Trainer` (the process edge: signals, termination log, exit code, live there).
Each step: gather this worker's shard of the global batch, stream it through the emulated IPU,
whose backward hands each layer's gradient to the :class:`Reducer` (allreduce + optimizer,
overlapped with the rest of backward). Every worker evaluates its share of the test set (so
the chief never stalls its peers past the step timeout); the chief (rank 0) checkpoints,
reports, writes ``--export`` and finally the marker that ends the evaluator. SIGTERM (via
``stop_requested``) stops after the current step and checkpoints.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from typing import TextIO

import numpy as np

from ringtrain import events
from ringtrain.errors import InvalidSpec
from ringtrain_trainer import divergence, optim, preflight, trace
from ringtrain_trainer.checkpoint import owner as ckpt_owner
from ringtrain_trainer.checkpoint.store import CheckpointManager, checkpoint_cap
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.feed import Feed
from ringtrain_trainer.data.npz import fit_model
from ringtrain_trainer.engine import native, plan
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.engine.multiloss import labels_for as label_buffer
from ringtrain_trainer.evaluator import clear_done, write_done
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.ipu.build import budget_for, build_ipu, compile_both, config_for
from ringtrain_trainer.ipu.device import MIN_SHARD_FLOPS
from ringtrain_trainer.ipu.pipeline import refuse
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.optim import numerics
from ringtrain_trainer.reducer import Reducer, StepCommStats
from ringtrain_trainer.telemetry import startup, tensorboard
from ringtrain_trainer.telemetry.metrics import TrainerMetrics
from ringtrain_trainer.telemetry.reporting import (
    PROGRESS_EVERY_S,
    Reporter,
    Throughput,
    metric_fields,
)
from ringtrain_trainer.worker_checkpoint import Checkpointing
from ringtrain_trainer.worker_eval import SharedEvaluation


class Trainer(SharedEvaluation, Checkpointing):
    """Everything one replica needs, built from a config; :meth:`run` trains and returns the
    final result dict."""

    def __init__(
        self,
        cfg: TrainerConfig,
        collective: Collective,
        dataset: data_mod.Dataset | None = None,
        metrics: TrainerMetrics | None = None,
        out: TextIO | None = None,
    ):
        self.cfg, self.collective = cfg, collective
        native.force(cfg.kernels)  # before compiling: each op picks its kernel at bind
        self.rank, self.world = collective.rank, collective.size
        # the collective's rank, not ``cfg.cluster.is_chief``: under mpirun TF_CONFIG is empty
        # on every rank, and tests hand in collectives without one
        self.is_chief = self.rank == 0
        self.metrics = metrics if metrics is not None else TrainerMetrics()
        self.report = Reporter(cfg.json, out if out is not None else sys.stdout, self.is_chief)
        self.stop_requested = threading.Event()
        preflight.check_outputs(cfg, self.is_chief)  # before data, compiling and any step
        self._owner = (
            ckpt_owner.claim(cfg.checkpoint_dir, cfg.token)
            if cfg.checkpoint_dir and self.is_chief
            else None
        )
        self._stop_agreed = False
        given = dataset

        def x_shape(_declared) -> tuple[int, ...]:  # only for a model with None input dims
            nonlocal dataset
            if dataset is None:
                dataset = data_mod.load(cfg.dataset, cfg.data_dir)
            return tuple(dataset.train.images.shape[1:])

        # refused by arithmetic (budget.check) before anything proportional to its size exists
        self.spec = keras_model.load(cfg.model, budget=budget_for(cfg), data=x_shape)
        self.spec.set_grid(plan.block_elems_for(self.world))
        if self.is_chief and self.spec.declared_input_shape is not None:
            print(
                f"ringtrain worker: input shape {self.spec.declared_input_shape} compiled as "
                f"{self.spec.config.input_shape}: its None dimensions fixed by the data's x "
                "(a static graph, as Poplar compiles; the export keeps them free)",
                file=sys.stderr,
            )
        self.params = self.spec.init(cfg.seed)
        #: what runs: the model's compile settings, each flag given overriding its part
        self.optimizer_spec = optim.for_run(cfg, self.spec)
        self.optimizer = optim.for_model(self.optimizer_spec, self.spec, self.params)
        self.tracer = trace.Tracer(cfg.trace_window, self.rank) if cfg.trace_steps else trace.OFF
        collective.tracer = self.tracer
        # the reducer owns the gradient buffer (and the stop vote after it); its thread
        # starts with the first step
        self.reducer = Reducer(
            self.spec.param_pieces,
            collective,
            self.optimizer,
            cfg.bucket_bytes,
            stop_vote=True,
            overlap=cfg.overlap_comm,
            tracer=self.tracer,
        )
        self.grads = self.reducer.grads
        #: precision, loss scaling, stochastic rounding (``numerics``)
        self.numerics = numerics.for_run(cfg, self.spec)
        self.loss_scale = self.numerics.loss_scale
        self.reducer.hook.hold = self.loss_scale.active
        self.reducer.wire_half = numerics.wire_half(cfg, self.numerics)
        if self.loss_scale.active and self.optimizer.sparse is not None:
            raise InvalidSpec(
                f"--loss-scaling {self.loss_scale.mode} is not supported with Embedding rows' "
                f"sparse optimizer state ({self.optimizer_spec.describe()})"
            )
        if cfg.pipeline_stages:
            refuse(
                self.numerics.precision,
                self.numerics.stochastic_rounding,
                self.loss_scale.mode if self.loss_scale.active else "off",
            )
        self.ipu = build_ipu(
            cfg,
            self.spec,
            config_for(
                cfg,
                optim.state_bytes_for(self.optimizer_spec, self.spec.num_params),
                host_threads=cfg.ipu_host_threads,
                min_shard_flops=MIN_SHARD_FLOPS,
                rank=self.rank,
                seed=cfg.seed,
                precision=self.numerics.precision,
                stochastic_rounding=self.numerics.stochastic_rounding,
            ),
            self.params,
            self.grads,
            tracer=self.tracer,
        )
        self.optimizer.threads = getattr(self.ipu, "host_threads", 1)
        self.exe, self.eval_batch = compile_both(self.ipu, cfg)
        self.metrics.update_status(
            optimizer=self.optimizer_spec.record(),
            loss_fn=self.spec.loss.record(),
            numerics=self.numerics.record(),
            accumulation=cfg.gradient_accumulation_steps,
        )
        print(f"ringtrain worker: {self.training_line()}", file=sys.stderr, flush=True)
        self.numerics_metrics = numerics.NumericsMetrics(
            self.metrics.registry,
            cfg.ipus_per_worker,
            cfg.gradient_accumulation_steps,
            self.numerics,
        )
        for line in self.ipu_lines():
            print(f"ringtrain worker: {line}", file=sys.stderr, flush=True)
        self.metrics.set_plan(
            self.exe.plan,
            memory.host_optimizer_state(cfg.variables_on_host, self.optimizer.state_bytes),
            baseline=self.exe.baseline,
            stages=getattr(self.exe, "stage_plans", None),
        )
        if cfg.pipeline_stages and self.optimizer.sparse is not None:
            raise InvalidSpec("pipeline.stages with an Embedding's sparse rows: not implemented")
        self.data = dataset if dataset is not None else data_mod.load(cfg.dataset, cfg.data_dir)
        self.data, note = fit_model(
            self.data, self.spec, cfg.data_dir if given is None else self.data.name
        )
        if note and self.is_chief:
            print(f"ringtrain worker: note: {note}", file=sys.stderr)
        #: micro-batches per step: the sharder hands each worker K of them at once
        self.micro = cfg.gradient_accumulation_steps
        if self.micro > 1 and self.optimizer.sparse is not None:
            raise InvalidSpec(
                "--gradient-accumulation-steps > 1 is not supported with Embedding rows' "
                f"sparse optimizer state ({self.optimizer_spec.describe()})"
            )
        self.sharder = data_mod.Sharder(
            len(self.data.train), cfg.batch_size * self.micro, self.world, self.rank, cfg.seed
        )
        print(f"ringtrain worker: {self.batch_line()}", file=sys.stderr, flush=True)
        #: steps skipped under dynamic loss scaling, against the bounds of "Succeeded"
        self.skips = divergence.Skips(self.total_steps)
        self.ckpt = (
            CheckpointManager(
                cfg.checkpoint_dir,
                cfg.checkpoint_keep,
                max_bytes=checkpoint_cap(self.params.nbytes, self.ipu.state.nbytes),
            )
            if cfg.checkpoint_dir
            else None
        )
        spec, b = self.spec, self.sharder.batch_size
        #: this worker's batches, from shards read ahead while a step runs (``data.feed``)
        self.feed = Feed(
            self.data.train, self.sharder, spec.input_shape,
            lambda: label_buffer(spec.loss, b, spec.num_classes),
        )  # fmt: skip
        self.step = 0
        self.position = data_mod.Position(0, 0, self.sharder.global_batch)
        self.last_checkpoint: str | None = None
        self.trace_file: str | None = None
        self.test_accuracy: float | None = None
        #: a model with several outputs: the last evaluation's values per output
        self.test_outputs: events.Values | None = None
        tb_dir = tensorboard.log_dir(cfg.tensorboard_dir, cfg.checkpoint_dir, "chief")
        self.tb = tensorboard.TrainWriter(tb_dir if self.is_chief else None, self.world)

    def training_line(self) -> str:
        return startup.training_line(self.optimizer_spec, self.spec, self.numerics)

    def batch_line(self) -> str:
        return startup.batch_line(self.cfg, self.world)

    def ipu_lines(self) -> list[str]:
        return startup.ipu_lines(self.cfg, self.spec, self.ipu, self.exe)

    @property
    def total_steps(self) -> int:
        if self.cfg.steps is not None:
            return self.cfg.steps
        return self.cfg.epochs * self.sharder.steps_per_epoch

    def _should_stop(self) -> bool:
        """Alone: as soon as asked. With peers: only once the request has travelled through
        a step's allreduce, so that every worker stops after the same step."""
        return self._stop_agreed or (self.world == 1 and self.stop_requested.is_set())

    def _done(self) -> bool:
        if self.cfg.steps is not None:
            return self.step >= self.cfg.steps
        return self.position.epoch >= self.cfg.epochs

    def _output_losses(self) -> events.Values | None:
        """A model with several outputs: this worker's last step's loss per output."""
        parts, loss = self.ipu.output_losses, self.spec.loss
        return None if parts is None or not isinstance(loss, MultiLossSpec) else loss.named(parts)

    def train_one_step(self) -> tuple[float, float, StepCommStats]:
        """One synchronous step; returns (loss, seconds, its communication statistics)."""
        t0, tr = time.perf_counter(), self.tracer
        tr.begin_step(self.step + 1)
        t0_ns, pos = tr.now(), self.position
        with tr.span(trace.DATA, "load batch"):
            x, y = self.feed.get(pos)
        self.reducer.begin_step(self.step, pos.epoch, stop=self.stop_requested.is_set())
        self.ipu.precision.loss_scale = self.loss_scale.scale
        # K micro-batches; the last streams the mean of all K (accumulate)
        loss = self.ipu.train_batch(self.exe, x, y, self.reducer.on_grad, step=self.step)
        loss += self.optimizer.penalty  # Keras' loss includes the regularizers' penalty
        comm = self.reducer.finish()
        rows = self.optimizer.sparse
        if rows is not None:  # the Embedding rows, once the global batch's squares are known
            rows.gather(self.spec, self.exe.programs, self.cfg.batch_size * self.world)
            rows.reduce(self.collective, self.step, tag=len(self.reducer.buckets))
            self.reducer.hook.apply_deferred()
        if not self._loss_scale_verdict():
            divergence.check_step(
                self.spec, self.grads, self.reducer.hook.nonfinite, loss, self._where(self.step + 1)
            )
        tr.end_step(
            t0_ns,
            allreduce_s=comm.allreduce_s,
            hidden_s=comm.hidden_s,
            exposed_wait_s=comm.exposed_wait_s,
        )
        vote = self.reducer.vote  # built with stop_vote=True: never None here
        if vote is not None and vote.agreed():
            self._stop_agreed = True
        self.step += 1
        self.position = self.sharder.advance(pos)
        return loss, time.perf_counter() - t0, comm

    def _loss_scale_verdict(self) -> bool:
        """With loss scaling, the held updates are applied (unscaled) or the step is skipped,
        by the reduced gradient: the same verdict on every worker. True: skipped."""
        ls = self.loss_scale
        if not ls.active:
            return False
        scale = ls.scale
        applied = ls.settle(self.grads, self.reducer.hook, self.optimizer)
        if ls.scale != scale:
            self.metrics.update_status(numerics=self.numerics.record())
            self.numerics_metrics.observe(ls, 0 if applied is not False else 1)
        skipped = applied is False
        if skipped:
            print(
                f"ringtrain worker: step {self.step + 1}: non-finite reduced gradient: step "
                f"skipped, loss scale {scale:g} -> {ls.scale:g}",
                file=sys.stderr,
                flush=True,
            )
        self.skips.record(skipped, ls.scale, self._where(self.step + 1))
        return skipped

    def _numerics_scalars(self) -> dict[str, float]:
        return startup.numerics_scalars(self.loss_scale, self.numerics, self.micro)

    def run(self) -> dict:
        self._restore()
        if self.ckpt is not None and self.is_chief:
            clear_done(self.ckpt.dir)
        cfg, total = self.cfg, self.total_steps
        first = self.step
        loss = float("nan")
        tput = Throughput()
        train_s = 0.0
        last_report = 0.0
        self.metrics.update_status(phase="Training", step=self.step, epoch=self.position.epoch)
        self.tb.start(self.step, self.ipu.stats)
        while not self._done() and not self._should_stop():
            self._collect_trace()
            loss, dt, comm = self.train_one_step()
            outs = self._output_losses()
            train_s += dt
            ema = tput.update(dt)
            sps = self.sharder.global_batch / ema
            self.metrics.observe_step(
                self.step,
                self.position.epoch,
                dt,
                loss,
                sps,
                self.ipu.stats,
                comm,
                self.feed.wait_s,
            )
            self.tb.observe(dt, self.ipu.stats, comm)
            now = time.perf_counter()
            if self.step == first + 1 or now - last_report >= PROGRESS_EVERY_S or self._done():
                last_report = now
                self.report.emit(
                    events.Progress(
                        step=self.step,
                        epoch=self.position.epoch,
                        loss=round(loss, 6),
                        samples_per_s=round(sps, 1),
                        eta_s=round(max(0, total - self.step) * ema, 1),
                        total_steps=total,
                        outputs=outs,
                    )
                )
                if outs:
                    self.metrics.update_status(outputs=outs)
                    if self.tb.on:
                        self.tb.scalars(self.step, {f"train/{k}": v for k, v in outs.items()})
                self.tb.progress(self.step, loss, self.optimizer.lr, sps)
                if self.tb.on:
                    self.tb.scalars(self.step, self._numerics_scalars())
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save(loss)
            if cfg.eval_every and self.step % cfg.eval_every == 0 and not self._done():
                self.evaluate()
        terminated = self._should_stop() and not self._done()
        last_loss = None if np.isnan(loss) else loss
        if not terminated:
            self.optimizer.finalize()  # use_ema: the weights become their average, as fit's end
        self.save(last_loss)
        export = None
        self._collect_trace(finished=True)
        if not terminated:
            self.evaluate()
            export = self.export(last_loss)
        done = self.step - first
        final = events.Final(
            steps=self.step,
            epoch=self.position.epoch,
            loss=None if np.isnan(loss) else round(loss, 6),
            **metric_fields(self.spec.loss.metric, self.test_accuracy),
            outputs=self._output_losses(),
            test_outputs=self.test_outputs,
            samples_per_s=round(done * self.sharder.global_batch / train_s, 1)
            if train_s > 0
            else 0.0,
            checkpoint=self.last_checkpoint,
            rank=self.rank,
            world_size=self.world,
            terminated=terminated,
            export=export,
            trace=self.trace_file,
            params_sha256=hashlib.sha256(self.params.data).hexdigest(),
            skipped_steps=self.skips.total if self.loss_scale.dynamic else None,
        )
        if not terminated and self.ckpt is not None and self.is_chief:
            write_done(self.ckpt.dir, final)  # the evaluator's signal to finish
        self.metrics.update_status(phase="Terminated" if terminated else "Succeeded")
        self.report.emit(final)
        return final.to_dict()

    def _collect_trace(self, finished: bool = False) -> None:
        """After the window (at the same step on every rank): the chief gathers the traces."""
        if self.tracer.due(self.step, finished):
            self.trace_file = trace.collect(
                self.tracer, self.collective, self.cfg.trace_dir or self.cfg.checkpoint_dir or "."
            )

    def close(self) -> None:
        if self._owner is not None:
            ckpt_owner.release(self._owner)
        self.tb.close()
        self.feed.close()
        self.reducer.close()
        self.ipu.close()
