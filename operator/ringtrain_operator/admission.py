"""The spec check: the spec's own rules, then what the API server would refuse in its Pods.

Pipeline position: :func:`load` is what the operator (``reconcile.load_spec``), ``ringtrain
render`` and ``ringtrain run`` call: :func:`.spec.load` (the CRD's schema, the relations between
fields), then :func:`check` of the Pods the job's kind renders, one per replica type (a type's
pods differ in names and addresses only). Each check is one the API server makes on every Pod:
before, its 422 came back at each pod creation, retried for ever with the job left Created
(issue 35); now the job is refused once, ``Failed``/``InvalidSpec``, naming the field:

- the trainer container's derived requests at most its limits (:mod:`.resources`; a template's
  own are checked as written, :mod:`.schedulable`): the derived request outgrows the derived
  limit when the memory plan outgrows ``ipuMemoryMB`` (a pipeline's
  ``gradientAccumulationSteps`` micro-batches in flight);
- one volume per mountPath in a container: the operator's volumes (checkpoints, data, the ring
  token, an MPI job's SSH key and configuration) and the template's.

An elastic job's Worker pod is checked at minReplicas too (:func:`.elastic.at_fewest`): there a
worker's share of the global batch, and with it the memory plan, is largest.

What the API server alone can know (quotas, admission webhooks, a namespace going away) is
judged when it answers (:mod:`.verdicts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringtrain.errors import InvalidSpec

from . import elastic, kinds, manifests, modelfrom, mpi, resources, schedulable, spec
from .job import Job, ReplicaSpec
from .limits import norm

#: Where each of the operator's volumes is chosen: the field a collision is named by.
_VOLUMES = {
    manifests.CHECKPOINT_VOLUME: "spec.trainer.checkpoint.path",
    manifests.DATA_VOLUME: "spec.trainer.data.path",
    modelfrom.VOLUME: "the model's (spec.trainer.modelFrom)",
    mpi.SSH_VOLUME: "spec.mpi.sshAuthMountPath",
    "tmp": "the operator's /tmp",
    "ring-token": "the ring token's",
    mpi.CONFIG_VOLUME: "the MPI hostfile's and sshd_config's",
    mpi.SSHD_VOLUME: "sshd's host key's",
}


def load(obj: Mapping[str, Any]) -> Job:
    """:func:`.spec.load`, then :func:`check`: a job the API server would accept every object
    of, or :class:`InvalidSpec` naming the field."""
    job = spec.load(obj)
    check(job)
    return job


def check(job: Job) -> None:
    kind = kinds.of(job)
    for r in job.replicas:
        pod = kind.pod(job, r, 0)
        _check_pod(job, r, pod)
    fewest = elastic.at_fewest(job)  # an elastic job's largest worker batch must fit too
    worker = fewest.replica("worker") if fewest is not None else None
    if fewest is not None and worker is not None and fewest.trainer is not None:
        try:
            _check_pod(fewest, worker, kind.pod(fewest, worker, 0))
        except InvalidSpec as e:
            raise InvalidSpec(
                f"spec.elasticPolicy.minReplicas: at minReplicas {worker.replicas} a worker's "
                f"batch is {fewest.trainer.batch_size}, which cannot run: {e}"
            ) from None


def _check_pod(job: Job, r: ReplicaSpec, pod: Mapping[str, Any]) -> None:
    pspec = pod.get("spec") or {}
    containers = [c for c in pspec.get("containers") or [] if isinstance(c, Mapping)]
    main = next((c for c in containers if c.get("name") == manifests.MAIN_CONTAINER), None)
    main = main if main is not None else (containers[0] if containers else None)
    if main is not None:
        _check_resources(job, r, main)
    for section in ("initContainers", "containers"):
        for i, c in enumerate(pspec.get(section) or []):
            if isinstance(c, Mapping):
                _check_mounts(r, c, f"spec.replicaSpecs.{r.key}.template.spec.{section}[{i}]")


def _derived(job: Job, r: ReplicaSpec, main: Mapping[str, Any]) -> bool:
    """Whether the main container's resources are the operator's (:func:`.resources.apply`:
    the trainer's container, none given in the template)."""
    if job.trainer is None:
        return False
    tspec = r.template.get("spec") if isinstance(r.template, Mapping) else None
    given = next(
        (
            t.get("resources") or {}
            for t in (tspec or {}).get("containers") or []
            if isinstance(t, Mapping) and t.get("name") == main.get("name")
        ),
        {},
    )
    return not (isinstance(given, Mapping) and (given.get("requests") or given.get("limits")))


def _check_resources(job: Job, r: ReplicaSpec, main: Mapping[str, Any]) -> None:
    """The resources the operator derived (a template's own are checked as written:
    :mod:`.schedulable`): a request above its limit names the trainer's fields."""
    if not _derived(job, r, main):
        return
    res = main.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for name in sorted(set(requests) & set(limits)):
        at = f"spec.trainer (the {r.key} pods' resources.{{}}.{name})"
        asked = schedulable.quantity(requests[name], at.format("requests"))
        if asked > schedulable.quantity(limits[name], at.format("limits")):
            raise InvalidSpec(_derived_message(job, r, name, requests[name], limits[name]))


def _derived_message(job: Job, r: ReplicaSpec, name: str, asked: Any, limit: Any) -> str:
    t = job.trainer
    assert t is not None
    depth = getattr(t, "gradient_accumulation_steps", 1) if t.pipeline_stages else None
    plan = f"batchSize {t.batch_size} on {t.ipus_per_worker} IPUs" + (
        f", {depth} micro-batches in flight (gradientAccumulationSteps)" if depth else ""
    )
    e = resources.estimate(t)
    if name == "memory" and e["ipu"] > e["ipu_capacity"]:
        # the worker's own refusal, in its words, before any pod exists
        ipus = int(t.ipus_per_worker)
        return (
            f"spec.trainer: the model does not fit the IPU: its memory plan for {plan} needs "
            f"{e['ipu'] // ipus:,} bytes per IPU, {e['ipu_capacity'] // ipus:,} available "
            f"(ipuMemoryMB {t.ipu_memory_mb}): lower spec.trainer."
            f"{'gradientAccumulationSteps or spec.trainer.' if depth else ''}batchSize, raise "
            "spec.trainer.ipuMemoryMB, allow recomputation (allowRecompute) or split the model "
            "over IPUs (pipeline.stages)"
        )
    return (
        f"spec.trainer: the {r.key} pods' {name} request {asked} (the memory plan of {plan}) "
        f"is more than their {name} limit {limit} (ipuMemoryMB {t.ipu_memory_mb} per IPU and "
        "the host's part), and the API server refuses a request above the limit: lower "
        f"spec.trainer.{'gradientAccumulationSteps or spec.trainer.' if depth else ''}"
        "batchSize, raise spec.trainer.ipuMemoryMB, or give the template's ringtrain "
        "container resources of its own"
    )


def _check_mounts(r: ReplicaSpec, c: Mapping[str, Any], where: str) -> None:
    seen: dict[str, str] = {}
    for m in c.get("volumeMounts") or []:
        if not isinstance(m, Mapping) or not isinstance(m.get("mountPath"), str):
            continue
        path, volume = norm(m["mountPath"]), str(m.get("name"))
        if path not in seen:
            seen[path] = volume
            continue
        other = seen[path]
        # name the field that chose the path: the later mount's, else the earlier's
        named = [_VOLUMES.get(v, f"{where}.volumeMounts") for v in (volume, other)]
        field = next((f for f in named if f.startswith("spec.")), f"{where}.volumeMounts")
        raise InvalidSpec(
            f"{field}: {m['mountPath']!r} is the mountPath of both volume {other!r} "
            f"({_what(other, where)}) and volume {volume!r} ({_what(volume, where)}) in the "
            f"{r.key} pods' container {str(c.get('name'))!r}; the API server refuses two "
            "mounts at one path: give each a path of its own"
        )


def _what(volume: str, where: str) -> str:
    said = _VOLUMES.get(volume)
    if said is None:
        return f"{where}.volumeMounts"
    return said if said.startswith("spec.") else f"{said} volume"
