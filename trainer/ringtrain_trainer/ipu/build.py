"""The worker's IPUs, chosen once from the run's settings: replicas, or the stages of a pipeline.

Pipeline position: ``worker.Trainer`` and ``ringtrain worker --report`` (``report.py``) build
their device here, so both run exactly the same one.
"""

from __future__ import annotations

from typing import Any

from ringtrain.errors import IPUCompileError
from ringtrain_trainer.config import TrainerConfig, layer_names
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.ipu.config import EVAL_BATCH, MB
from ringtrain_trainer.ipu.device import IPU, IPUConfig
from ringtrain_trainer.ipu.executable import Executable
from ringtrain_trainer.ipu.pipeline import PipelinedIPU


def config_for(cfg: TrainerConfig, optimizer_state_bytes: int, **run: Any) -> IPUConfig:
    """The device a run's flags describe; ``run``: what the worker adds (host threads, its
    rank, precision, the shard floor), the memory report leaving the rest at their defaults."""
    return IPUConfig(
        memory_bytes=cfg.ipu_memory_mb * MB,
        variables_on_host=cfg.variables_on_host,
        replicas=cfg.ipus_per_worker,
        optimizer_state_bytes=optimizer_state_bytes,
        accumulation=cfg.gradient_accumulation_steps,
        recompute=cfg.allow_recompute,
        recompute_checkpoints=layer_names(cfg.recomputation_checkpoints),
        available_memory_proportion=cfg.available_memory_proportion,
        **run,
    )


def build_ipu(cfg: TrainerConfig, spec: ModelSpec, config: IPUConfig, params, grads, tracer) -> IPU:
    """Replicas of ``spec``, or with ``pipeline.stages`` the stages of a pipeline."""
    if not cfg.pipeline_stages:
        return IPU(spec, config, params, grads, tracer=tracer)
    return PipelinedIPU(
        spec,
        config,
        params,
        grads,
        tracer,
        stages=cfg.pipeline_stages,
        schedule=cfg.pipeline_schedule,
    )


def budget_for(cfg: TrainerConfig) -> tuple[int, int]:
    """The memory and the batch a model must fit before it is built (``keras.budget``): one
    IPU and its share of the batch, or with ``pipeline.stages`` all IPUs and one micro-batch
    (the stages share the model)."""
    if cfg.pipeline_stages:
        return cfg.ipus_per_worker * cfg.ipu_memory_mb * MB, cfg.batch_size
    return cfg.ipu_memory_mb * MB, max(1, cfg.batch_size // cfg.ipus_per_worker)


def compile_both(ipu: IPU, cfg: TrainerConfig) -> tuple[Executable, int]:
    """The training program and the evaluation program, compiled (their memory checked)
    before any data is loaded; the training one and the evaluation batch size. A pipeline
    evaluates in its micro-batches, as it trains; an IPU too small for the evaluation batch
    evaluates in training-sized batches, which fit."""
    exe = ipu.compile(cfg.batch_size, train=True)
    eval_batch = cfg.batch_size if cfg.pipeline_stages else EVAL_BATCH
    try:
        ipu.compile(eval_batch, train=False)
    except IPUCompileError:
        eval_batch = cfg.batch_size
        ipu.compile(eval_batch, train=False)
    return exe, eval_batch
