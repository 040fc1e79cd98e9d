"""Files too large for one ConfigMap, copied onto a claim the job owns before it starts.

Pipeline position: :class:`.kube.KubeBackend` ``submit`` creates the job suspended
(``runPolicy.suspend``: the operator makes no pod), then a claim per input over a ConfigMap's
1 MiB (the model, the data; a smaller one still goes in a ConfigMap), then the file cut
into ConfigMaps of at most :data:`CHUNK_BYTES`, and a short-lived writer pod that mounts them
all (one projected volume) and the claim, joins the file's parts, checks its SHA-256 and
renames it into place; the parts are deleted and the job resumed. So, as ``kubectl cp`` copies
through a pod, but with no exec rights: creating ConfigMaps and pods suffices, which a user who
can create a TrainingJob's inputs has. Everything is owned by the job, so deleting it removes
the claim; ``kubectl get tj -o yaml`` names the claim the files came from.

Bounded: :data:`MAX_UPLOAD_BYTES` in all (each part is an API object in etcd), refused beyond
with the sizes named. The job's pods mount the claim read-only; a ReadWriteOnce claim serves
pods on one node (kind's, the local cluster's), several nodes need a ReadWriteMany class.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
from typing import Any

from kubernetes import client
from kubernetes.client import ApiException

from ringtrain_operator import manifests

from . import output

#: one part's bytes: under a ConfigMap's 1 MiB with room for its metadata
CHUNK_BYTES = 1_000_000
#: the files of one job, in all: 64 parts
MAX_UPLOAD_BYTES = 64 * CHUNK_BYTES
#: where the writer pod sees the parts and the claim
PARTS_MOUNT, CLAIM_MOUNT = "/parts", "/claim"

#: the writer's program: for each "file digest part..." argument, join, check, rename
_WRITE = (
    "import hashlib, os, sys\n"
    "for spec in sys.argv[1:]:\n"
    "    name, digest, *parts = spec.split(':')\n"
    "    data = b''.join(open(f'/parts/{p}', 'rb').read() for p in parts)\n"
    "    if hashlib.sha256(data).hexdigest() != digest:\n"
    "        sys.exit(f'{name}: the parts do not add up to its SHA-256')\n"
    "    with open(f'/claim/.{name}.part', 'wb') as f:\n"
    "        f.write(data)\n"
    "    os.replace(f'/claim/.{name}.part', f'/claim/{name}')\n"
    "    print(name, len(data), digest)\n"
)


def claim_name(job: str, what: str) -> str:
    """The claim of one input (``model``, ``data``): one each, since a pod mounting one claim
    as two volumes never starts on Kubernetes before 1.23 (the kubelet waits for a mount)."""
    return f"{job}-{what}"


def too_big(sizes: dict[str, int]) -> str | None:
    total = sum(sizes.values())
    if total <= MAX_UPLOAD_BYTES:
        return None
    each = ", ".join(f"{k} {v:,}" for k, v in sizes.items())
    return (
        f"the files are {total:,} bytes ({each}); the client copies at most "
        f"{MAX_UPLOAD_BYTES:,} onto a claim (in ConfigMap parts of {CHUNK_BYTES:,}): put "
        "larger data on a PersistentVolumeClaim yourself and name it in spec= "
        "(trainer.data.volume)"
    )


def claim(job: str, what: str, namespace: str, storage_class: str, total: int) -> dict[str, Any]:
    mib = max(64, math.ceil(1.25 * total / (1 << 20)))  # the files and a margin
    return output.pvc(claim_name(job, what), job, namespace, storage_class, f"{mib}Mi")


def parts(prefix: str, namespace: str, files: dict[str, bytes]) -> tuple[list[dict], list[str]]:
    """(the ConfigMaps ``<prefix>-part-NNNN`` holding every file's parts, the writer's
    arguments); the caller labels and owns them."""
    maps: list[dict[str, Any]] = []
    args = []
    for name, data in files.items():
        keys = []
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            key = f"p{len(maps):04d}"
            maps.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": f"{prefix}-part-{len(maps):04d}",
                        "namespace": namespace,
                    },
                    "binaryData": {
                        key: base64.b64encode(data[start : start + CHUNK_BYTES]).decode()
                    },
                }
            )
            keys.append(key)
        args.append(":".join([name, hashlib.sha256(data).hexdigest(), *keys]))
    return maps, args


def writer_pod(
    job: str,
    what: str,
    namespace: str,
    container: dict[str, Any],
    maps: list[dict],
    args: list[str],
) -> dict[str, Any]:
    sources = [{"configMap": {"name": m["metadata"]["name"]}} for m in maps]
    return output.helper_pod(
        f"{job}-upload-",
        job,
        namespace,
        container,
        ["python", "-c", _WRITE, *args],
        [
            {"name": "parts", "mountPath": PARTS_MOUNT, "readOnly": True},
            {"name": "claim", "mountPath": CLAIM_MOUNT},
        ],
        [
            {"name": "parts", "projected": {"sources": sources}},
            {"name": "claim", "persistentVolumeClaim": {"claimName": claim_name(job, what)}},
        ],
    )


def copy(
    core: client.CoreV1Api,
    namespace: str,
    job: str,
    what: str,
    container: dict[str, Any],
    files: dict[str, bytes],
    owner: dict[str, Any],
) -> None:
    """Create the parts, run the writer to its end, delete the parts (the claim stays)."""
    maps, args = parts(f"{job}-{what}", namespace, files)
    for m in maps:
        m["metadata"]["ownerReferences"] = [owner]
        m["metadata"]["labels"] = {manifests.LABEL_JOB: job}
        core.create_namespaced_config_map(namespace, m)
    try:
        pod = writer_pod(job, what, namespace, container, maps, args)
        pod["metadata"]["ownerReferences"] = [owner]
        output.run_pod(core, namespace, pod, f"{job}: copying its {what} onto its claim")
    finally:
        for m in maps:  # never hides the first error; any left are the job's, deleted with it
            with contextlib.suppress(ApiException):
                core.delete_namespaced_config_map(m["metadata"]["name"], namespace)
