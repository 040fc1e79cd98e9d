"""The ConfigMaps and Secrets of the job's own file: what ``ringtrain run`` mounts where a
kubelet would read the API (docs/decisions/0206-shipping-a-model-to-pods.md).

Pipeline position: :func:`read` takes them from the multi-document file beside the TrainingJob;
:func:`.plan.plan` mounts them like the kubelet (``paths.secret_data``: ``data`` and
``binaryData``), and :func:`model_from` refuses, before anything starts, a
``spec.trainer.modelFrom`` this machine cannot provide — a ConfigMap or Secret that is not in the
file, a key it lacks, a claim (there is no cluster to bind it) — naming the field; otherwise it
says what is mounted where.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_operator import modelfrom, yamlsafe
from ringtrain_operator.job import Job

KINDS = ("ConfigMap", "Secret")


def read(path: str) -> list[dict]:
    """The file's v1 ConfigMaps and Secrets (the TrainingJob is :func:`.plan.read_job`'s)."""
    try:
        with open(path) as f:
            docs = yamlsafe.load_all(f, path)
    except OSError as e:
        raise InvalidSpec(f"{path}: {e.strerror}") from None
    return [
        d
        for d in docs
        if isinstance(d, dict) and d.get("apiVersion") == "v1" and d.get("kind") in KINDS
    ]


def _files(obj: Mapping[str, Any]) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys and contents, as its volume's files."""
    out: dict[str, bytes] = {}
    encoded = ("binaryData",) if obj["kind"] == "ConfigMap" else ("data",)
    for field in ("data", "binaryData", "stringData"):
        for k, v in (obj.get(field) or {}).items():
            try:
                out[k] = base64.b64decode(v, validate=True) if field in encoded else v.encode()
            except (binascii.Error, AttributeError, TypeError):
                raise InvalidSpec(
                    f"{obj['kind']} {obj['metadata'].get('name')!r} {field}.{k}: not "
                    f"{'base64' if field in encoded else 'a string'}"
                ) from None
    return out


def model_from(job: Job, sources: Iterable[Mapping[str, Any]]) -> str | None:
    """``spec.trainer.modelFrom`` made local: a line saying what is mounted where, None without
    it; :class:`InvalidSpec` naming the field for what this machine cannot provide."""
    mf = job.trainer.model_from if job.trainer is not None else None
    if not mf:
        return None
    kind, ref = modelfrom.source(mf)
    field = f"{modelfrom.FIELD}.{kind}"
    if kind == "persistentVolumeClaim":
        name = modelfrom.relative_path(mf).rsplit("/", 1)[-1]
        raise InvalidSpec(
            f"{field}: ringtrain run has no cluster to bind claim {ref['claimName']!r} from; "
            "to run this job here, give the file's path on this machine as spec.trainer.model "
            f"instead (e.g. model: /home/me/{name}), or ship it in a ConfigMap in the job's "
            "own file (ringtrain model-configmap)"
        )
    obj_kind = "ConfigMap" if kind == "configMap" else "Secret"
    namespace = job.namespace
    obj = next(
        (
            s
            for s in sources
            if s.get("kind") == obj_kind
            and (s.get("metadata") or {}).get("name") == ref["name"]
            and (s["metadata"].get("namespace") or namespace) == namespace
        ),
        None,
    )
    if obj is None:
        raise InvalidSpec(
            f"{field}.name: {obj_kind} {ref['name']!r} is not in the job's file; ringtrain run "
            f"mounts a {obj_kind} only from the TrainingJob's own multi-document YAML file "
            f"(append the output of `ringtrain model-configmap FILE --name {ref['name']}`)"
        )
    files = _files(obj)
    size = sum(len(k) + len(v) for k, v in files.items())
    if (why := modelfrom.too_big(size, f"{obj_kind} {ref['name']!r}")) is not None:
        raise InvalidSpec(f"{field}: {why}")
    if ref["key"] not in files:
        raise InvalidSpec(
            f"{field}.key: {obj_kind} {ref['name']!r} in the job's file has no key "
            f"{ref['key']!r} (its keys: {', '.join(sorted(files)) or 'none'})"
        )
    return (
        f"{modelfrom.FIELD}: {modelfrom.describe(mf)} ({len(files[ref['key']]):,} bytes, from "
        f"the job's file) mounted read-only at {modelfrom.pod_path(mf)}"
    )
