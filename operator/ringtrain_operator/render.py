"""``ringtrain render job.yaml``: every object the operator would create, like ``helm template``.

The objects come from the very functions the operator uses (:mod:`.admission`, :mod:`.manifests`),
so what is printed is what the cluster gets — except the ring token, which is random per job and is
redacted, and the ownerReferences, which need the uid the API server assigns on creation. The
NetworkPolicy comes last: the one the chart's default (``networkPolicy.enabled``, Prometheus in
the ``monitoring`` namespace) makes the operator create; ``--no-network-policy`` leaves it out,
as an operator installed without it creates none.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterable

import yaml

from ringtrain.errors import InvalidSpec

from . import admission, kinds, modelfrom, networkpolicy, spec, tfjob, yamlsafe

#: Shown instead of secret values (valid base64, so the output still validates).
REDACTED = "REDACTED"


def redact(obj: dict) -> dict:
    if obj.get("kind") != "Secret":
        return obj
    out = copy.deepcopy(obj)
    out["data"] = dict.fromkeys(out.get("data", {}), REDACTED)
    return out


def render(
    docs: Iterable[dict],
    namespace: str | None = None,
    network: networkpolicy.Settings | None = networkpolicy.Settings(),  # noqa: B008 (frozen)
) -> list[dict]:
    """Every object for every TrainingJob in ``docs``, secrets redacted; with ``network``, the
    job's NetworkPolicy after them. The file's own ConfigMaps and Secrets are not repeated."""
    objects: list[dict] = []
    for doc in docs:
        if doc is None or _beside(doc):
            continue
        if namespace:
            doc = {**doc, "metadata": {**(doc.get("metadata") or {}), "namespace": namespace}}
        job = admission.load(doc)
        kind = kinds.of(job)
        objects += [redact(o) for o in kind.rendered(job)]
        if network is not None:
            objects.append(kind.network_policy(job, network))
    return objects


def _beside(doc: dict) -> bool:
    """An object a job's file holds for it (the ConfigMap of spec.trainer.modelFrom): created
    by the file's ``kubectl create``, not by the operator."""
    return doc.get("apiVersion") == "v1" and doc.get("kind") in modelfrom.FILE_KINDS


def dump(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def _converted(doc: dict, source: str) -> dict:
    """A TFJob document as the TrainingJob it becomes, saying so on stderr."""
    if not tfjob.is_tfjob(doc):
        return doc
    job, notes = tfjob.convert(doc)
    print(f"ringtrain render: {source}: converted: {'; '.join(notes)}", file=sys.stderr)
    return job


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ringtrain render", description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", help="TrainingJob YAML ('-' = stdin)")
    p.add_argument(
        "--namespace", "-n", help="namespace to render for (default: the file's, else 'default')"
    )
    p.add_argument("--crd", action="store_true", help="print the TrainingJob CRD instead")
    p.add_argument(
        "--no-network-policy",
        action="store_true",
        help="leave out the NetworkPolicy (as an operator installed with "
        "networkPolicy.enabled=false creates none)",
    )
    args = p.parse_args(argv)
    if args.crd:
        sys.stdout.write(dump([spec.crd()]))
        return 0
    if not args.file:
        p.error("a TrainingJob file is required (or --crd)")
    try:
        with sys.stdin if args.file == "-" else open(args.file) as fh:
            docs = yamlsafe.load_all(fh, args.file)
    except (OSError, InvalidSpec) as e:
        print(f"ringtrain render: {e}", file=sys.stderr)
        return 2
    try:
        docs = [_converted(d, args.file) for d in docs]
        network = None if args.no_network_policy else networkpolicy.Settings()
        sys.stdout.write(dump(render(docs, args.namespace, network)))
    except InvalidSpec as e:
        print(f"ringtrain render: {args.file}: {e}", file=sys.stderr)
        return 2
    return 0
