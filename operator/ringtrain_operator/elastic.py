"""spec.elasticPolicy: the worker counts a job may run at, and the job at another count (pure).

Pipeline position: :func:`.spec.load` calls :func:`policy` once the replicas and the trainer are
typed, so the operator, ``ringtrain render`` and ``ringtrain run`` refuse the same policies;
``ringtrain run``'s resize (``ringtrain_localrun.resize``) calls :func:`resized` for the job at
the new count and plans it as any job, through the same admission.

What a resize keeps is the **global batch** (examples per optimizer step over the ring): a
worker's batch becomes ``global / (N x K)``. The sample order is a function of (seed, epoch,
global batch) alone (``Sharder``), and the ring averages the workers' mean gradients, so N
workers x B/N train exactly as one worker x B (tests/ring/test_equivalence.py); a run resized at
a step boundary, resuming from the checkpoint of that step, therefore trains the very steps of
an unresized run (decision 0213). TorchElastic and Horovod Elastic keep the per-worker batch
instead: the global batch, and with it the model, changes with every resize.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from ringtrain import options
from ringtrain.errors import InvalidSpec

from .job import ElasticPolicy, Job, MPISpec, ReplicaSpec, TrainerSpec

__all__ = [
    "admitted",
    "at_fewest",
    "check_count",
    "pod_parts",
    "policy",
    "resized",
    "running_at",
    "size_document",
    "sizes_that_work",
]

_BATCH = f"spec.trainer.{options.BY_NAME['batch_size'].crd}"
#: spec.elasticPolicy.shrinkAfterSeconds when absent: a lost worker's grace before the job goes
#: on without it
SHRINK_AFTER_S = 60


def sizes_that_work(global_batch: int, sizes: range, per_worker_divisor: int) -> list[int]:
    """The worker counts among ``sizes`` that share ``global_batch`` out evenly: every worker an
    equal batch, and that batch a multiple of ``per_worker_divisor`` (micro-batches x IPUs)."""
    return [n for n in sizes if global_batch % (n * per_worker_divisor) == 0]


def policy(
    raw: Mapping[str, Any] | None,
    replicas: tuple[ReplicaSpec, ...],
    trainer: TrainerSpec | None,
    mpi: MPISpec | None,
) -> ElasticPolicy | None:
    """spec.elasticPolicy checked against the replicas and the trainer, or None when unset;
    :class:`InvalidSpec` naming the field of the first rule broken. An absent minReplicas or
    maxReplicas is the Worker count (Kubeflow's default)."""
    if raw is None:
        return None
    if mpi is not None:
        raise InvalidSpec(
            "spec.elasticPolicy: an MPI job's world is mpirun's, fixed at its launch; remove "
            "spec.elasticPolicy or spec.mpi"
        )
    if trainer is None:
        raise InvalidSpec(
            "spec.elasticPolicy: needs spec.trainer: the built-in trainer is what keeps the "
            "global batch and the sample order across a resize"
        )
    if any(r.role == "chief" for r in replicas):
        raise InvalidSpec(
            "spec.replicaSpecs.Chief: an elastic job's ring is its Workers (worker 0 is the "
            "chief and stays through every resize); remove the Chief replica"
        )
    workers = next(r.replicas for r in replicas if r.role == "worker")
    lo, hi = int(raw.get("minReplicas", workers)), int(raw.get("maxReplicas", workers))
    if lo > hi:
        raise InvalidSpec(f"spec.elasticPolicy.minReplicas: {lo} is more than maxReplicas {hi}")
    if not lo <= workers <= hi:
        raise InvalidSpec(
            f"spec.replicaSpecs.Worker.replicas: {workers} is outside spec.elasticPolicy's "
            f"[minReplicas, maxReplicas] = [{lo}, {hi}]"
        )
    k = trainer.gradient_accumulation_steps
    divisor = k * trainer.ipus_per_worker
    global_batch = trainer.batch_size * k * workers
    sizes = range(lo, hi + 1)
    good = sizes_that_work(global_batch, sizes, divisor)
    if len(good) < len(sizes):
        bad = [n for n in sizes if n not in good]
        every = math.lcm(*(n * divisor for n in sizes))
        suggest = -(-global_batch // every) * every
        how = f"{_BATCH} {trainer.batch_size} x {workers} Worker.replicas" + (
            f" x gradientAccumulationSteps {k}" if k > 1 else ""
        )
        unit = f" (a multiple of {divisor} per worker)" if divisor > 1 else ""
        raise InvalidSpec(
            f"spec.elasticPolicy: the global batch {global_batch} ({how}) is kept across "
            f"resizes but does not divide evenly{unit} among {_counts(bad)} workers; of "
            f"[{lo}, {hi}] the sizes that work: {', '.join(map(str, good)) or 'none'}. "
            f"Narrow [minReplicas, maxReplicas] to them, or make the global batch {suggest}, "
            "which every size divides"
        )
    shrink = int(raw.get("shrinkAfterSeconds", SHRINK_AFTER_S))
    return ElasticPolicy(lo, hi, raw.get("maxRestarts"), global_batch, shrink)


def _counts(ns: list[int]) -> str:
    return ", ".join(map(str, ns[:-1])) + (" or " if len(ns) > 1 else "") + str(ns[-1])


def check_count(elastic: ElasticPolicy | None, workers: int) -> ElasticPolicy:
    """``elastic`` if it allows ``workers``, else :class:`InvalidSpec` saying why."""
    if elastic is None:
        raise InvalidSpec(
            "spec.elasticPolicy: not set, so the job's worker count is fixed; set "
            "minReplicas and maxReplicas to resize it"
        )
    if workers not in elastic.sizes():
        raise InvalidSpec(
            f"spec.replicaSpecs.Worker.replicas: {workers} is outside spec.elasticPolicy's "
            f"[minReplicas, maxReplicas] = [{elastic.min_replicas}, {elastic.max_replicas}]"
        )
    return elastic


def resized(obj: Mapping[str, Any], elastic: ElasticPolicy | None, workers: int) -> dict:
    """The TrainingJob object ``obj`` (as written, before defaults) at ``workers`` workers:
    Worker.replicas set, and spec.trainer.batchSize the share of the same global batch. The
    policy's bounds are written out, so the object is admitted by the same rules it was.
    :class:`InvalidSpec` names what refuses the count."""
    elastic = check_count(elastic, workers)
    out = copy.deepcopy(dict(obj))
    spec = out["spec"]
    trainer = spec["trainer"]
    k = int(trainer.get(options.BY_NAME["gradient_accumulation_steps"].crd, 1))
    spec["replicaSpecs"].setdefault("Worker", {})["replicas"] = workers
    trainer[options.BY_NAME["batch_size"].crd] = elastic.global_batch // (workers * k)
    spec["elasticPolicy"] = {
        **spec["elasticPolicy"],
        "minReplicas": elastic.min_replicas,
        "maxReplicas": elastic.max_replicas,
    }
    return out


def at_fewest(job: Job) -> Job | None:
    """The job at minReplicas, where a worker's batch is largest — what admission must also
    find runnable (the memory plan grows with the batch) — or None when that is the job itself.
    """
    e, t = job.elastic, job.trainer
    worker = job.replica("worker")
    if e is None or t is None or worker is None or worker.replicas == e.min_replicas:
        return None
    n = e.min_replicas
    batch = e.global_batch // (n * t.gradient_accumulation_steps)
    return dataclasses.replace(
        job,
        replicas=tuple(
            dataclasses.replace(r, replicas=n) if r is worker else r for r in job.replicas
        ),
        trainer=dataclasses.replace(t, batch_size=batch),
    )


#: status.elastic: what the job was admitted with and the size it runs at (issue 38)
STATUS_KEY = "elastic"


def running_at(obj: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The TrainingJob as it runs, and why a count it asks for is refused ("" if none).

    Once admitted, an elastic job's global batch is the one of its creation (status.elastic):
    an edited ``Worker.replicas`` within the policy's bounds is the job at that count with its
    share of that global batch (:func:`resized`), not ``batchSize`` x the new count. A count the
    policy refuses (outside the bounds, or one the global batch does not divide into) leaves
    the job at the count it runs at, and the refusal names the field — a running job is never
    failed for an edit."""
    status, spec = obj.get("status"), obj.get("spec")
    rec = status.get(STATUS_KEY) if isinstance(status, Mapping) else None
    raw = spec.get("elasticPolicy") if isinstance(spec, Mapping) else None
    if not (isinstance(rec, Mapping) and isinstance(raw, Mapping) and isinstance(spec, Mapping)):
        return obj, ""
    g, current = rec.get("globalBatch"), rec.get("workers")
    if not isinstance(g, int) or not isinstance(current, int) or g < 1 or current < 1:
        return obj, ""
    try:
        asked = int(spec["replicaSpecs"]["Worker"].get("replicas", 1))
        lo = int(raw.get("minReplicas", rec.get("minReplicas", current)))
        hi = int(raw.get("maxReplicas", rec.get("maxReplicas", current)))
        trainer = spec.get("trainer") or {}
        k = int(trainer.get(options.BY_NAME["gradient_accumulation_steps"].crd, 1))
        ipus = int(trainer.get(options.BY_NAME["ipus_per_worker"].crd, 1))
    except (TypeError, ValueError, KeyError, AttributeError):
        return obj, ""  # spec.load names what is wrong
    if k < 1 or ipus < 1 or lo < 1 or hi > 1024 or asked < 1:
        return obj, ""  # spec.load names what is wrong
    why, divisor = "", k * ipus
    bad = [n for n in range(lo, hi + 1) if not sizes_that_work(g, range(n, n + 1), divisor)]
    if lo > hi:
        why = f"spec.elasticPolicy.minReplicas: {lo} is more than maxReplicas {hi}"
    elif bad:
        why = (
            f"spec.elasticPolicy: [minReplicas, maxReplicas] = [{lo}, {hi}] is refused: the "
            f"job's global batch {g} does not divide evenly among "
            f"{_counts(bad)} workers"
        )
    elif not lo <= asked <= hi:
        why = (
            f"spec.replicaSpecs.Worker.replicas: {asked} is outside spec.elasticPolicy's "
            f"[minReplicas, maxReplicas] = [{lo}, {hi}]"
        )
    written = trainer.get(options.BY_NAME["batch_size"].crd)
    note = ""
    if written not in (rec.get("batchSize"), g // (asked * k)):  # neither as created nor the share
        note = (
            f"spec.trainer.batchSize: {written} is not applied to a running elastic job; it "
            f"keeps the global batch {g} of its creation (a worker's batch is {g} / workers)"
        )
    shrunk = rec.get("shrunkTo")  # a worker lost: the job goes on with fewer (``.resizing``)
    if isinstance(shrunk, int) and lo <= shrunk < asked:
        asked = shrunk
    if not why:
        return resized(obj, ElasticPolicy(lo, hi, raw.get("maxRestarts"), g), asked), note
    lo, hi = int(rec.get("minReplicas", current)), int(rec.get("maxReplicas", current))
    kept = ElasticPolicy(min(lo, current), max(hi, current), raw.get("maxRestarts"), g)
    why = f"{why}; the job goes on with {current} workers"
    return resized(obj, kept, current), f"{why}. {note}" if note else why


def admitted(job: Job) -> dict[str, int]:
    """status.elastic as the job is first admitted."""
    assert job.elastic is not None
    worker = job.replica("worker")
    return {
        "globalBatch": job.elastic.global_batch,
        "batchSize": job.trainer.batch_size if job.trainer else 0,
        "minReplicas": job.elastic.min_replicas,
        "maxReplicas": job.elastic.max_replicas,
        "workers": worker.replicas if worker else 0,
        "resizes": 0,
    }


#: the pod annotation holding a worker's size document, projected by the downward API into
#: :data:`SIZE_FILE`, which the trainer reads (``ringtrain_trainer.elastic``)
ANNOTATION = "ringtrain.io/elastic"
SIZE_DIR = "/etc/ringtrain/elastic"
SIZE_FILE = f"{SIZE_DIR}/size.json"
SIZE_ENV = "RINGTRAIN_ELASTIC_FILE"


def size_document(job: Job, tf_config: str) -> str:
    """A worker's size file at the job's count: its TF_CONFIG and its batch. The operator
    patches it onto the pods that stay when the count changes; the kubelet updates the file
    within a second (a pod update, unlike a ConfigMap's, syncs the pod at once)."""
    worker, t = job.replica("worker"), job.trainer
    assert worker is not None and t is not None
    doc = {"workers": worker.replicas, "batchSize": t.batch_size, "tfConfig": tf_config}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def pod_parts() -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The downward API volume, its mount and the variable naming the file."""
    ref = {"fieldPath": f"metadata.annotations['{ANNOTATION}']"}
    volume = {"name": "elastic", "downwardAPI": {"items": [{"path": "size.json", "fieldRef": ref}]}}
    mount = {"name": "elastic", "mountPath": SIZE_DIR, "readOnly": True}
    return volume, mount, {"name": SIZE_ENV, "value": SIZE_FILE}
