"""Bounds on what one tenant's TrainingJob can cost the operator, every tenant's (issue 20).

Pipeline position: called by ``spec.load`` — :func:`check_depth` before anything copies or
validates the object, :func:`check_mounts` with the semantic checks. Each closes a way a spec
made every reconcile fail the same way forever (a retry every 5 s) instead of one
``Failed``/``InvalidSpec`` and one Event: a Pod template nested 500 deep (``copy.deepcopy``
recursed past Python's limit), a checkpoint path on another mount's path (the API server
refused every Pod). The numbers' bounds are the CRD schema's (``options.py``, ``runPolicy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringtrain.errors import InvalidSpec

from . import manifests
from .job import ReplicaSpec, TrainerSpec

#: Deepest nesting a TrainingJob may have (a Pod template needs about 15 levels): deeper, and
#: copying or validating it recursed past Python's limit at every reconcile (issue 20).
MAX_DEPTH = 64


def too_deep(obj: Any) -> str | None:
    """The path of the first value nested deeper than :data:`MAX_DEPTH`, or None; iterative,
    so the check cannot itself run out of stack."""
    stack = [(obj, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            return path
        if isinstance(value, Mapping):
            stack += [(v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value)]
    return None


def check_depth(obj: Any) -> None:
    if (path := too_deep(obj)) is not None:
        raise InvalidSpec(f"{path[:200]}: nested deeper than {MAX_DEPTH} levels")


def check_mounts(replicas: tuple[ReplicaSpec, ...], trainer: TrainerSpec) -> None:
    """The checkpoint volume's mountPath must be its own: the API server refuses a Pod with two
    mounts at one path, which failed every pod creation, retried forever (issue 20)."""
    own = {"/tmp": "the operator's /tmp volume", manifests.TOKEN_DIR: "the ring token's volume"}
    if trainer.data_volume:
        own[trainer.data_mount_path or "/data"] = "spec.trainer.data's volume"
    path = norm(trainer.checkpoint_dir)
    for taken, what in own.items():
        if path == norm(taken):
            raise InvalidSpec(
                f"spec.trainer.checkpoint.path: {trainer.checkpoint_dir!r} is the mountPath of "
                f"{what}; give the checkpoints a path of their own"
            )
    for r in replicas:
        containers = _containers(r)
        main = next((c for c in containers if c.get("name") == manifests.MAIN_CONTAINER), None)
        main = main if main is not None else (containers[0] if containers else {})
        mounts = main.get("volumeMounts") or []
        if not isinstance(mounts, list):
            raise InvalidSpec(
                f"spec.replicaSpecs.{r.key}.template.spec.containers[].volumeMounts: must be a "
                f"list, got {type(mounts).__name__}"
            )
        for m in mounts:
            if (
                isinstance(m, Mapping)
                and m.get("name") != manifests.CHECKPOINT_VOLUME
                and isinstance(m.get("mountPath"), str)
                and norm(m["mountPath"]) == path
            ):
                raise InvalidSpec(
                    f"spec.trainer.checkpoint.path: {trainer.checkpoint_dir!r} is also the "
                    f"mountPath of volume {m.get('name')!r} in spec.replicaSpecs.{r.key}."
                    "template; give the checkpoints a path of their own"
                )


def _containers(r: ReplicaSpec) -> list[Mapping[str, Any]]:
    """The template's containers, refused naming the field when they are not a list of objects
    (the schema keeps a Pod template as the user wrote it; the API server would refuse it at
    pod creation, after the job was accepted)."""
    where = f"spec.replicaSpecs.{r.key}.template.spec"
    pod = r.template.get("spec") or {}
    if not isinstance(pod, Mapping):
        raise InvalidSpec(f"{where}: must be an object (a PodSpec), got {type(pod).__name__}")
    containers = pod.get("containers") or []
    if not isinstance(containers, list) or not all(isinstance(c, Mapping) for c in containers):
        raise InvalidSpec(f"{where}.containers: must be a list of containers (objects)")
    return containers


def norm(path: str) -> str:
    return "/" + "/".join(p for p in str(path).split("/") if p and p != ".")
