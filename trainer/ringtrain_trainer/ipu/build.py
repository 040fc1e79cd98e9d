"""The worker's IPUs, chosen once from the run's settings: replicas, or the stages of a pipeline.

Pipeline position: ``worker.Trainer`` and ``ringtrain worker --report`` (``report.py``) build
their device here, so both run exactly the same one.
"""

from __future__ import annotations

from typing import Any

from ringtrain_trainer.config import TrainerConfig, layer_names
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.ipu.config import MB
from ringtrain_trainer.ipu.device import IPU, IPUConfig
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
