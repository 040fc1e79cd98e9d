"""The worker's IPUs, chosen once from the run's settings: replicas, or the stages of a pipeline.

Pipeline position: ``worker.Trainer`` and ``ringtrain worker --report`` (``report.py``) build
their device here, so both run exactly the same one.
"""

from __future__ import annotations

from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.ipu.device import IPU, IPUConfig
from ringtrain_trainer.ipu.pipeline import PipelinedIPU


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
