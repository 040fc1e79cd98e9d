"""What an emulated IPU is configured with and what it counts: :class:`IPUConfig`, host threads,
BLAS limits and :class:`IPUStats`.

Split out of :mod:`.device` so the settings and counters (read by the worker, the
metrics exporter, TensorBoard and the benches) stand apart from the compile-and-run machinery;
:mod:`ringtrain_trainer.ipu.device` re-exports every name, so existing imports keep working.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from threadpoolctl import threadpool_limits

from ringtrain import options

MB = 1 << 20
#: examples per evaluation program run
EVAL_BATCH = 500


#: a shard costs ≈ 0.6-2 ms of numpy per-op overhead on small tensors whatever its size, and
#: numpy's small calls hold the GIL, so two shards of a small model run no faster than one:
#: a batch with less work than this per shard runs on fewer. 0.5 MFLOP (issue 24's third
#: round) left convnext/mobilenet (2.7-3.1 MFLOP a shard) and transformer_block on two shards
#: at 0.63-0.72x TensorFlow by CPU; at 8 MFLOP one shard runs them at 1.48-2.03x (README,
#: decisions, fourth round). The seeds' CNN at batch 64 (~93 MFLOP a shard) keeps two.
MIN_SHARD_FLOPS = 8_000_000


@dataclass(frozen=True)
class IPUConfig:
    memory_bytes: int = options.DEFAULTS["ipu_memory_mb"] * MB
    variables_on_host: bool = options.DEFAULTS["variables_on_host"]
    replicas: int = options.DEFAULTS["ipus_per_worker"]
    #: bytes of optimizer state the program must hold when variables are *not* on the host
    optimizer_state_bytes: int = 0
    #: host threads standing in for the IPU's tiles (0: the CPUs this process may use)
    host_threads: int = 1
    #: the least training work (``flops_per_example`` x shard batch) worth a shard of its own:
    #: below it fewer host threads split the batch (0: every thread always gets a shard)
    min_shard_flops: int = 0
    #: this worker's rank and the run's seed: with the step, what Dropout's masks depend on
    rank: int = 0
    seed: int = 0
    #: micro-batches whose gradients the IPU sums before streaming once (``accumulate``)
    accumulation: int = 1
    #: ``fp16``: float16 forward and backward (:mod:`.engine.precision`), or ``fp32``
    precision: str = "fp32"
    stochastic_rounding: str = "OFF"
    #: Graphcore's ``allow_recompute`` (``engine.recompute``), and the layers whose outputs
    #: are the checkpoints (empty: chosen by the plan)
    recompute: bool = False
    recompute_checkpoints: tuple[str, ...] = ()
    #: Graphcore's ``availableMemoryProportion`` (``engine.workspace``); None: whole-batch
    #: conv workspaces
    available_memory_proportion: float | None = None


def resolve_host_threads(requested: int) -> int:
    """``requested``, or for 0 the CPUs this process may run on (at most 8)."""
    if requested > 0:
        return requested
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def blas_limits(host_threads: int) -> contextlib.AbstractContextManager:
    """Single-threaded BLAS inside the shards, so the emulated IPU uses ``host_threads`` CPUs
    and no more (threadpoolctl: a dependency of the project)."""
    return threadpool_limits(limits=1, user_api="blas")


@dataclass
class IPUStats:
    """Cumulative counters, read by the metrics exporter."""

    compiles: int = 0
    recompiles: int = 0
    weights_in_bytes: int = 0
    grads_out_bytes: int = 0
    data_in_bytes: int = 0
    compute_s: float = 0.0
    flops: int = 0
    steps: int = 0
    #: bytes over the inter-IPU links between pipeline stages (``pipeline_ipu``)
    link_bytes: int = 0
    #: per pipeline stage: seconds its thread spent computing (forward, backward, links)
    stage_busy_s: tuple[float, ...] = ()
