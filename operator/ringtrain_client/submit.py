"""``ringtrain submit FILE``: start a job from its manifest and return at once — on a cluster
(``--backend kubernetes``: the TrainingJob and the ConfigMaps and Secrets beside it are
created, as ``kubectl create -f`` would) or locally (``ringtrain run`` in the background, its
run dir under ``--root``). A Kubeflow TFJob file is converted first, saying so.

Why beside ``kubectl`` and ``ringtrain run``: one verb for both places, the job's name printed
(``--json``) for ``ringtrain wait|logs|status`` to follow, and a file refused whole — an object
of a kind it does not create is named before anything is created — never half-applied.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from kubernetes.client import ApiException
from kubernetes.config.config_exception import ConfigException

from ringtrain.errors import InvalidSpec
from ringtrain_operator import tfjob, yamlsafe
from ringtrain_operator.job import API_VERSION, GROUP, KIND, PLURAL, VERSION

from .cli import EXIT_NOT_FOUND, parser
from .client import TrainerClient
from .kube import KubeBackend
from .local import LocalBackend

#: what a file may hold beside its one TrainingJob (the ConfigMaps and Secrets it mounts)
BESIDE = {("v1", "ConfigMap"), ("v1", "Secret")}
EXIT_INVALID = 2


def documents(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(the TrainingJob, the objects beside it, what the conversion of a TFJob said)."""
    try:
        with open(path) as f:
            docs = [d for d in yamlsafe.load_all(f, path) if d is not None]
    except OSError as e:
        raise InvalidSpec(f"{path}: {e.strerror}") from None
    notes: list[str] = []
    jobs, beside = [], []
    for i, d in enumerate(docs):
        if tfjob.is_tfjob(d):
            d, notes = tfjob.convert(d)
        kind = (d.get("apiVersion"), d.get("kind")) if isinstance(d, dict) else None
        if kind == (API_VERSION, KIND):
            jobs.append(d)
        elif kind in BESIDE:
            beside.append(d)
        else:
            raise InvalidSpec(
                f"{path}: document {i + 1} is {kind}: submit creates one TrainingJob (or TFJob) "
                "and the ConfigMaps and Secrets beside it; apply others with kubectl"
            )
    if len(jobs) != 1:
        raise InvalidSpec(f"{path}: expected exactly one TrainingJob document, found {len(jobs)}")
    for d in (*jobs, *beside):
        if not isinstance((d.get("metadata") or {}).get("name"), str):
            raise InvalidSpec(f"{path}: a {d.get('kind')} without metadata.name")
    return jobs[0], beside, notes


def create(backend: KubeBackend, job: dict[str, Any], beside: list[dict[str, Any]]) -> str:
    """The objects beside first (the pods mount them), then the TrainingJob; when one is
    refused, those this call made are deleted again (never half-applied)."""
    ns, core = backend.namespace, backend.core
    made: list[tuple[Any, str]] = []
    try:
        for obj in beside:
            name = obj["metadata"]["name"]
            if obj["kind"] == "ConfigMap":
                core.create_namespaced_config_map(ns, obj)
                made.append((core.delete_namespaced_config_map, name))
            else:
                core.create_namespaced_secret(ns, obj)
                made.append((core.delete_namespaced_secret, name))
        created = backend.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
    except BaseException:
        for delete, name in made:
            with contextlib.suppress(ApiException):
                delete(name, ns)
        raise
    return str(created["metadata"]["name"])


def _why(e: ApiException) -> str:
    """The API server's message (its Status body), else the HTTP reason."""
    try:
        return str(json.loads(e.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


def main(argv: list[str]) -> int:
    p: argparse.ArgumentParser = parser(
        "submit",
        "Start a job from its manifest (a TrainingJob, or a Kubeflow TFJob) and return: on a "
        "cluster with --backend kubernetes, else as local processes in the background.",
        name=False,
    )
    p.add_argument("file", metavar="FILE", help="the job's YAML")
    args = p.parse_args(argv)
    try:
        job, beside, notes = documents(args.file)
    except InvalidSpec as e:
        print(f"ringtrain submit: {e}", file=sys.stderr)
        return EXIT_INVALID
    if notes:
        print(f"ringtrain submit: {args.file}: converted: {'; '.join(notes)}", file=sys.stderr)
    try:
        client = TrainerClient(
            args.backend, root=args.root, namespace=args.namespace, kubeconfig=args.kubeconfig
        )
    except (ConfigException, OSError, ValueError) as e:  # no kubeconfig: say so, no traceback
        print(f"ringtrain submit: {args.backend}: {e}", file=sys.stderr)
        return EXIT_INVALID
    b = client.backend
    if isinstance(b, LocalBackend):
        name = b.start(args.file, job["metadata"]["name"])
    else:
        assert isinstance(b, KubeBackend)
        try:
            name = create(b, job, beside)
        except ApiException as e:
            print(f"ringtrain submit: {args.file}: {_why(e)}", file=sys.stderr)
            return EXIT_NOT_FOUND if e.status == 404 else EXIT_INVALID
    print(json.dumps({"submitted": name, "backend": b.name}) if args.json else name)
    return 0
