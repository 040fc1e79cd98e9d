"""TrainingJob objects for the operator tests, built the way users write them (YAML-like dicts)."""

from __future__ import annotations

import copy
from typing import Any

from ringtrain_operator import spec
from ringtrain_operator.job import Job


def job_obj(
    name: str = "mnist",
    *,
    workers: int = 2,
    chief: int | None = None,
    ps: int | None = None,
    evaluator: int | None = None,
    policy: str = "ExitCode",
    trainer: dict | None = None,
    run_policy: dict | None = None,
    uid: str | None = "uid-1",
    **extra_spec: Any,
) -> dict:
    replica_specs: dict[str, Any] = {"Worker": {"replicas": workers, "restartPolicy": policy}}
    for key, n in (("Chief", chief), ("PS", ps), ("Evaluator", evaluator)):
        if n is not None:
            replica_specs[key] = {"replicas": n, "restartPolicy": policy}
    meta: dict[str, Any] = {"name": name, "namespace": "team-a", "generation": 1}
    if uid:
        meta["uid"] = uid
    body: dict[str, Any] = {"replicaSpecs": replica_specs, **extra_spec}
    if ps and trainer is None:
        # PS needs a stock TensorFlow job: the built-in trainer refuses it.
        for rs in replica_specs.values():
            rs["template"] = {
                "spec": {
                    "containers": [{"name": "tensorflow", "image": "tensorflow/tensorflow:2.16.1"}]
                }
            }
        return {
            "apiVersion": "ringtrain.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": meta,
            "spec": body,
        }
    body["trainer"] = (
        copy.deepcopy(trainer) if trainer is not None else {"dataset": "mnist-5k", "steps": 20}
    )
    if evaluator and trainer is None:  # the evaluator reads the chief's checkpoints
        body["trainer"]["checkpoint"] = {
            "volume": {"persistentVolumeClaim": {"claimName": "checkpoints"}}
        }
    if run_policy is not None:
        body["runPolicy"] = run_policy
    return {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": meta,
        "spec": body,
    }


def job(**kw: Any) -> Job:
    return spec.load(job_obj(**kw))
