"""A Kubeflow TFJob (``kubeflow.org/v1``) as a TrainingJob: the renames, Kubeflow's defaults kept,
and every field that cannot come along named with why — never dropped silently.

Why: Kubeflow Trainer v2 deprecated TensorFlow, so TFJob users need a home, and a TrainingJob is
three renames away (``apiVersion``/``kind``, ``tfReplicaSpecs`` → ``replicaSpecs`` with
``Master`` as TFJob's alias of ``Chief``, ``spec.successPolicy`` → ``spec.runPolicy``). The
conversion is a pure function: ``ringtrain convert`` prints its result, ``ringtrain render`` and
``ringtrain run`` apply it to a TFJob file and say so.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from ringtrain.errors import InvalidSpec

from . import yamlsafe
from .job import API_VERSION, KIND

TFJOB_API_VERSION, TFJOB_KIND = "kubeflow.org/v1", "TFJob"
#: TFJob replica types → TrainingJob's (Master is TFJob's older name of Chief)
ROLES = {
    "Chief": "Chief",
    "Master": "Chief",
    "Worker": "Worker",
    "PS": "PS",
    "Evaluator": "Evaluator",
}
#: Kubeflow's default restartPolicy for a TFJob replica (training-operator's DefaultRestartPolicy)
DEFAULT_RESTART_POLICY = "Never"
#: RunPolicy fields a TrainingJob has under the same names
RUN_POLICY = (
    "cleanPodPolicy",
    "backoffLimit",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "suspend",
)
#: TFJob fields a TrainingJob has no counterpart for, and why each is left out
DROPPED = {
    "runPolicy.schedulingPolicy": "gang scheduling through Volcano or scheduler-plugins is not "
    "supported (ringtrain's pods carry Kueue's pod-group labels instead)",
    "runPolicy.managedBy": "ringtrain's operator manages every TrainingJob",
    "enableDynamicWorker": "TFJob's dynamic workers join a parameter-server job, which has no "
    "counterpart here; a TrainingJob resizes its ring with spec.elasticPolicy (minReplicas, "
    "maxReplicas: decision 0213)",
}


def is_tfjob(doc: Any) -> bool:
    return (
        isinstance(doc, Mapping)
        and doc.get("apiVersion") == TFJOB_API_VERSION
        and doc.get("kind") == TFJOB_KIND
    )


def convert(doc: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """(the TrainingJob, one note per field renamed, defaulted or left out)."""
    if not is_tfjob(doc):
        raise InvalidSpec(
            f"apiVersion/kind: expected {TFJOB_API_VERSION}/{TFJOB_KIND}, "
            f"got {doc.get('apiVersion')}/{doc.get('kind')}"
        )
    spec = doc.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise InvalidSpec("spec: must be an object")
    notes = [f"{TFJOB_API_VERSION} {TFJOB_KIND} -> {API_VERSION} {KIND}"]
    replicas: dict[str, Any] = {}
    for key, rs in (spec.get("tfReplicaSpecs") or {}).items():
        if key not in ROLES:
            raise InvalidSpec(
                f"spec.tfReplicaSpecs.{key}: not a TFJob replica type ({', '.join(ROLES)})"
            )
        role = ROLES[key]
        if role in replicas:
            raise InvalidSpec("spec.tfReplicaSpecs: both Chief and Master (one chief only)")
        out = copy.deepcopy(dict(rs or {}))
        if "restartPolicy" not in out:
            out["restartPolicy"] = DEFAULT_RESTART_POLICY
            notes.append(f"{role}: restartPolicy {DEFAULT_RESTART_POLICY} (TFJob's default)")
        if key != role:
            notes.append(f"spec.tfReplicaSpecs.{key} -> spec.replicaSpecs.{role}")
        replicas[role] = out
    run_policy = {k: v for k, v in (spec.get("runPolicy") or {}).items() if k in RUN_POLICY}
    success = spec.get("successPolicy")
    if success == "AllWorkers":
        run_policy["successPolicy"] = "AllWorkers"
        notes.append("spec.successPolicy -> spec.runPolicy.successPolicy")
    elif success not in (None, ""):
        raise InvalidSpec(f"spec.successPolicy: {success!r} is not a TFJob success policy")
    for field, why in DROPPED.items():
        where, _, name = field.rpartition(".")
        holder = (spec.get(where) or {}) if where else spec
        if isinstance(holder, Mapping) and holder.get(name) not in (None, False, {}):
            notes.append(f"spec.{field}: left out ({why})")
    meta = {
        k: copy.deepcopy(v)
        for k, v in (doc.get("metadata") or {}).items()
        if k in ("name", "namespace", "labels", "annotations")
    }
    job = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        "spec": {"replicaSpecs": replicas, **({"runPolicy": run_policy} if run_policy else {})},
    }
    return job, notes


def main(argv: list[str]) -> int:
    """``ringtrain convert tfjob.yaml``: the TrainingJob on stdout, what changed on stderr."""
    p = argparse.ArgumentParser(
        prog="ringtrain convert",
        description="Print a Kubeflow TFJob (kubeflow.org/v1) file as a TrainingJob; every "
        "field renamed, defaulted or left out is named on stderr.",
    )
    p.add_argument("file", help="TFJob YAML ('-' = stdin)")
    args = p.parse_args(argv)
    try:
        with sys.stdin if args.file == "-" else open(args.file) as fh:
            docs = [d for d in yamlsafe.load_all(fh, args.file) if d]
        found = [d for d in docs if is_tfjob(d)]
        if not found:
            raise InvalidSpec(f"no {TFJOB_API_VERSION} {TFJOB_KIND} document")
        out = []
        for d in found:
            job, notes = convert(d)
            print(f"ringtrain convert: {'; '.join(notes)}", file=sys.stderr)
            out.append(job)
    except (OSError, InvalidSpec) as e:
        print(f"ringtrain convert: {args.file}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0
