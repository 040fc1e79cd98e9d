"""``ringtrain worker --report``: the IPU memory report of a run, without data, peers or training.

Pipeline position: beside the worker. It builds the model, the optimizer and the device exactly
as :class:`ringtrain_trainer.worker.Trainer` does (``ipu.build``), plans one step and prints
:func:`ringtrain_trainer.ipu.memory.format_report`'s table, then compiles.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer import optim, trace
from ringtrain_trainer.config import layer_names
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.engine import recompute
from ringtrain_trainer.ipu.build import build_ipu, config_for
from ringtrain_trainer.ipu.memory import format_report, host_optimizer_state
from ringtrain_trainer.ipu.pipeline import PipelinedIPU
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.optim import numerics


def report(cfg, out) -> None:
    """``ringtrain worker --report``: plan the training program of ``cfg`` (a ``TrainerConfig``)
    as the worker would, print the table to ``out``, then compile it — without data, peers or
    training. A program that does not fit raises :class:`~ringtrain.errors.IPUCompileError`
    after its table was printed, so the table shows what to cut."""
    # a model with None input dimensions is planned at the data's shape, as the worker runs it
    spec = keras_load.build(
        cfg.model, lambda _: data_mod.load(cfg.dataset, cfg.data_dir).train.images.shape[1:]
    )
    params = spec.init(cfg.seed)
    opt = optim.for_run(cfg, spec)
    state = optim.state_bytes_for(opt, spec.num_params)
    run = numerics.for_run(cfg, spec)  # the precision the worker would compute in
    checkpoints = layer_names(cfg.recomputation_checkpoints)
    ipu = build_ipu(
        cfg,
        spec,
        config_for(
            cfg,
            state,
            host_threads=1,
            precision=run.precision,
            stochastic_rounding=run.stochastic_rounding,
        ),
        params,
        np.zeros_like(params),
        trace.OFF,
    )
    host = host_optimizer_state(cfg.variables_on_host, state)
    try:
        r = cfg.ipus_per_worker
        where = "host" if cfg.variables_on_host else "IPU"
        frozen = spec.num_frozen
        head = (
            f"IPU memory report: model {spec.name}, {spec.num_params:,} parameters, "
            f"optimizer {opt.name} (state on the {where}), {run.precision}"
            + (f", {spec.num_frozen:,} frozen parameters held as state" if frozen else "")
        )
        declared = spec.declared_input_shape
        if declared is not None:
            head += f", input {declared} fixed to {spec.config.input_shape} by the data's x"
        if isinstance(ipu, PipelinedIPU):  # compiled first: a refusal names the largest stage
            exe = ipu.compile(cfg.batch_size)
            k = cfg.gradient_accumulation_steps
            for st, p in zip(ipu.stages, exe.stage_plans or [], strict=True):
                title = (
                    f"{head}, micro-batch {cfg.batch_size} x gradient accumulation {k} (depth); "
                    f"{st.describe(spec)} on IPU {st.index}"
                )
                print(format_report(p, host, title) + "\n", file=out, flush=True)
            return
        if cfg.batch_size % r:
            ipu.compile(cfg.batch_size)  # raises InvalidSpec: the batch does not divide
        per_ipu = cfg.batch_size // r
        title = (
            f"{head}, batch {cfg.batch_size} = "
            f"{per_ipu} per IPU x {r} IPU{'s' if r > 1 else ''}; bytes per IPU"
        )
        base = shown = ipu.plan(per_ipu, True)
        if cfg.allow_recompute:
            size = ipu.dtype.itemsize
            cuts = recompute.choose(spec, base, per_ipu, size, checkpoints)
            shown = recompute.plan(spec, base, per_ipu, size, cuts)
            title += "; with recomputation"
        print(format_report(shown, host, title), file=out, flush=True)
        if cfg.available_memory_proportion is not None:
            split = [f"{r.name} x{r.pieces}" for r in shown.by_layer if r.pieces > 1]
            print(
                f"available memory proportion {cfg.available_memory_proportion}: conv workspaces "
                f"in serial pieces: {', '.join(split) or 'none needed'}",
                file=out,
                flush=True,
            )
        if shown is not base:
            print(
                f"recomputation: peak {shown.total:,} bytes with it, {base.total:,} without",
                file=out,
                flush=True,
            )
        ipu.compile(cfg.batch_size)
    finally:
        ipu.close()
