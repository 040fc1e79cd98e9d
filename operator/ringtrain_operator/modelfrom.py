"""spec.trainer.modelFrom: a model file of yours shipped to the trainer pods (decision 0206).

Pipeline position: :func:`.spec.load` refuses what cannot run (:func:`check`) and gives the
worker the file's path in the pod as its model (:func:`pod_path`); :func:`.manifests.pod` mounts
:func:`volume` read-only at :data:`MOUNT_DIR` in every trainer pod; ``ringtrain model-configmap``
(:func:`main`) prints the ConfigMap of a local ``.keras`` file. The operator reads none of these
objects: the kubelet mounts them, so its RBAC needs nothing for them.

The three sources are Kubernetes' own spellings: a key reference's ``name``/``key`` (as in
``configMapKeyRef``, ``secretKeyRef``) and a claim's ``claimName`` with a ``path`` in it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import posixpath
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ringtrain import options
from ringtrain.errors import InvalidSpec

FIELD = "spec.trainer.modelFrom"
#: Where the model's volume is mounted in the trainer pods (beside the ring token's).
MOUNT_DIR = "/var/run/ringtrain/model"
#: The pod volume's name: ringtrain's own, unlikely to be a template's.
VOLUME = "ringtrain-model"
#: Owner and group read: the pod's fsGroup is the trainer's group; never world-readable.
FILE_MODE = 0o440
#: Kubernetes' limit on one ConfigMap or Secret: its keys and values together, 1 MiB.
MAX_OBJECT_BYTES = 1 << 20
SOURCES = ("configMap", "secret", "persistentVolumeClaim")
#: Kinds a job's own file may hold beside the TrainingJob for its modelFrom (``ringtrain
#: render`` and ``ringtrain run`` skip them; ``ringtrain run`` mounts ConfigMaps and Secrets).
FILE_KINDS = ("ConfigMap", "Secret", "PersistentVolumeClaim")
#: A ConfigMap's or Secret's key that names a model file (the CRD's pattern).
KEY_PATTERN = options.MODEL_FROM_SCHEMA["properties"]["configMap"]["properties"]["key"]["pattern"]
#: The ConfigMap's annotation naming its file's digest (``ringtrain model-configmap``).
SHA256_ANNOTATION = "ringtrain.io/model-sha256"


def source(model_from: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """The one source set (the schema allows exactly one) and its fields."""
    (kind,) = (k for k in SOURCES if k in model_from)
    return kind, model_from[kind]


def relative_path(model_from: Mapping[str, Any]) -> str:
    """The file's path under :data:`MOUNT_DIR`: the key (a ConfigMap's or Secret's file is
    named after it) or the path in the claim."""
    kind, ref = source(model_from)
    return posixpath.normpath(ref["path"] if kind == "persistentVolumeClaim" else ref["key"])


def pod_path(model_from: Mapping[str, Any]) -> str:
    """The worker's ``--model``: the file in the pod."""
    return f"{MOUNT_DIR}/{relative_path(model_from)}"


def volume(model_from: Mapping[str, Any]) -> dict[str, Any]:
    """The pod volume: only the named key of a ConfigMap or Secret, or the whole claim
    read-only (the file's path in it is ``--model``'s)."""
    kind, ref = source(model_from)
    if kind == "persistentVolumeClaim":
        return {
            "name": VOLUME,
            "persistentVolumeClaim": {"claimName": ref["claimName"], "readOnly": True},
        }
    items = [{"key": ref["key"], "path": ref["key"]}]
    if kind == "secret":
        return {
            "name": VOLUME,
            "secret": {"secretName": ref["name"], "items": items, "defaultMode": FILE_MODE},
        }
    return {
        "name": VOLUME,
        "configMap": {"name": ref["name"], "items": items, "defaultMode": FILE_MODE},
    }


def mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}


def describe(model_from: Mapping[str, Any]) -> str:
    """``ConfigMap 'my-model' key 'model.keras'``, ``PersistentVolumeClaim 'models' path
    'mnist/model.keras'``: the source in words."""
    kind, ref = source(model_from)
    if kind == "persistentVolumeClaim":
        return f"PersistentVolumeClaim {ref['claimName']!r} path {ref['path']!r}"
    return f"{kind[0].upper()}{kind[1:]} {ref['name']!r} key {ref['key']!r}"


def conflict(trainer: Mapping[str, Any]) -> str | None:
    """Why spec.trainer's ``model`` and ``modelFrom`` cannot both stand, or None.

    modelFrom replaces ``model``, so only model's default (``cnn``, which the API server fills
    in) may stand beside it; anything else set with it is refused, naming both fields, rather
    than one of them silently ignored (and an inline model is not even checked)."""
    if trainer.get("modelFrom") is None:
        return None
    model = trainer.get("model", options.DEFAULTS["model"])
    if model == options.DEFAULTS["model"]:
        return None
    what = "an inline Keras config" if isinstance(model, Mapping) else repr(model)
    return (
        f"spec.trainer.model and {FIELD}: both name the model (model is {what}); set one: "
        "modelFrom ships a file to the pods and replaces model"
    )


def check(trainer: Mapping[str, Any]) -> None:
    """A defaulted, schema-valid spec.trainer's modelFrom: refused naming the field when it
    cannot run (a claim's path that leaves the claim: the schema's RE2 has no lookahead)."""
    model_from = trainer.get("modelFrom")
    if model_from is None:
        return
    if (why := conflict(trainer)) is not None:
        raise InvalidSpec(why)
    kind, ref = source(model_from)
    if kind == "persistentVolumeClaim" and ".." in ref["path"].split("/"):
        raise InvalidSpec(
            f"{FIELD}.persistentVolumeClaim.path: {ref['path']!r} leaves the claim; give the "
            "file's path inside it, relative, without '..'"
        )


# --- ringtrain model-configmap ---------------------------------------------------------------


def too_big(size: int, what: str) -> str | None:
    """Why ``size`` bytes (keys included) cannot be one ConfigMap or Secret, or None."""
    if size <= MAX_OBJECT_BYTES:
        return None
    return (
        f"{what} is {size:,} bytes; a ConfigMap or Secret holds at most {MAX_OBJECT_BYTES:,} "
        "(1 MiB, Kubernetes' limit): put the file on a PersistentVolumeClaim and name it in "
        f"{FIELD}.persistentVolumeClaim {{claimName, path}} (docs/your-model-and-data.md)"
    )


def configmap(name: str, key: str, content: bytes, namespace: str | None = None) -> dict[str, Any]:
    """The ConfigMap holding ``content`` under ``key`` (binaryData), with its digest."""
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["annotations"] = {SHA256_ANNOTATION: hashlib.sha256(content).hexdigest()}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "binaryData": {key: base64.b64encode(content).decode()},
    }


def configmap_text(
    path: str, name: str, key: str | None = None, namespace: str | None = None
) -> str:
    """``ringtrain model-configmap``'s output: a comment saying how to use it, then the
    ConfigMap. Refuses (:class:`InvalidSpec`) a file that is not a model or is over 1 MiB."""
    suffix = Path(path).suffix
    if suffix not in (".keras", ".json"):
        raise InvalidSpec(f"{path}: not a .keras or .json model file")
    key = key or f"model{suffix}"
    if Path(key).suffix != suffix or not re.match(KEY_PATTERN, key):
        raise InvalidSpec(
            f"--key {key!r}: letters, digits, '-', '_' and '.', ending in {suffix} like {path} "
            "(the file's name in the pods)"
        )
    try:
        content = Path(path).read_bytes()
    except OSError as e:
        raise InvalidSpec(f"{path}: {e.strerror}") from None
    if suffix == ".keras" and not content.startswith(b"PK\x03\x04"):
        raise InvalidSpec(f"{path}: not a .keras archive (a zip file, as model.save writes)")
    if (why := too_big(len(key) + len(content), path)) is not None:
        raise InvalidSpec(why)
    ref = f"{{configMap: {{name: {name}, key: {key}}}}}"
    head = (
        f"# {Path(path).name} ({len(content):,} bytes) for spec.trainer.modelFrom: {ref}\n"
        "# kubectl create -f this file (or kubectl apply --server-side): client-side\n"
        "# kubectl apply also copies it into an annotation limited to 256 KiB.\n"
    )
    body = yaml.safe_dump(configmap(name, key, content, namespace), sort_keys=False, width=1 << 30)
    return head + body


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ringtrain model-configmap",
        description="Print a ConfigMap holding a .keras (or .json) model file as binaryData, "
        "for spec.trainer.modelFrom.configMap; files over 1 MiB go on a PersistentVolumeClaim.",
    )
    p.add_argument("file", help="the model file (model.save(...) writes a .keras)")
    p.add_argument("--name", required=True, help="the ConfigMap's name")
    p.add_argument(
        "--key", help="the key, the file's name in the pods (default model.keras / model.json)"
    )
    p.add_argument("--namespace", "-n", help="the ConfigMap's namespace (default: kubectl's)")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(configmap_text(args.file, args.name, args.key, args.namespace))
    except InvalidSpec as e:
        print(f"ringtrain model-configmap: {e}", file=sys.stderr)
        return 2
    return 0
