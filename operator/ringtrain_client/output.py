"""A cluster job's output volume: where the chief's export outlives its pod, and how the client
reads it back.

Pipeline position: :class:`.kube.KubeBackend` ``submit`` creates a PersistentVolumeClaim owned
by the job (deleting the job removes it) and names it as the job's checkpoint volume, where the
chief writes its checkpoints and the export; ``model()`` reads the export through a short-lived
pod that mounts the claim read-only and prints the file — its size and SHA-256, then base64
lines — to its log, as ``kubectl cp`` would copy it but with no exec rights (reading a pod's log
suffices). The claim needs a storage class: the one the client was given, else the cluster's
default; without either nothing outlives the chief's pod and ``model()`` says so.

A container's log is rotated by the kubelet at 10 MiB (containerLogMaxSize), so a file read
this way is bounded: :data:`MAX_FETCH_BYTES`, beyond it the reader refuses, naming the sizes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import time
from typing import Any

from kubernetes import client
from kubernetes.client import ApiException

from ringtrain_operator import manifests

#: the claim's request: checkpoints (``keep`` of them) and the export of a small model
OUTPUT_SIZE = "1Gi"
#: a file read through a pod's log: its base64 (4/3 the size, a newline per 76 characters)
#: stays under the kubelet's 10 MiB log rotation
MAX_FETCH_BYTES = 7 * 1024 * 1024
FETCH_TIMEOUT_S = 180
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
#: marks the client's short-lived pods, which are not the job's replicas
HELPER_LABEL = "ringtrain.io/client-helper"

#: the reader's program (the trainer image's Python): size and digest, then the file
_READ = (
    "import base64, hashlib, sys\n"
    "data = open(sys.argv[1], 'rb').read()\n"
    "print(len(data), hashlib.sha256(data).hexdigest())\n"
    "if len(data) <= int(sys.argv[2]):\n"
    "    sys.stdout.write(base64.encodebytes(data).decode())\n"
)


def claim_name(job: str) -> str:
    return f"{job}-output"


def default_storage_class(api: client.ApiClient) -> str | None:
    """The cluster's default StorageClass, or None (none marked, or no right to list them)."""
    try:
        classes = client.StorageV1Api(api).list_storage_class().items
    except ApiException as e:
        if e.status in (401, 403):
            return None
        raise
    marked = (
        sc.metadata.name
        for sc in classes
        if (sc.metadata.annotations or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
    )
    return next(marked, None)


def claim(job: str, namespace: str, storage_class: str) -> dict[str, Any]:
    return pvc(claim_name(job), job, namespace, storage_class, OUTPUT_SIZE)


def pvc(name: str, job: str, namespace: str, storage_class: str, size: str) -> dict[str, Any]:
    """A ReadWriteOnce claim of ``size`` labelled as ``job``'s (the caller owns it to the job):
    the output claim here and each input claim of :mod:`.upload`."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {manifests.LABEL_JOB: job},
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": storage_class,
            "resources": {"requests": {"storage": size}},
        },
    }


def reader_pod(
    job: str, namespace: str, container: dict[str, Any], claim: str, mount: str, path: str
) -> dict[str, Any]:
    """A pod that prints ``path`` (inside the claim mounted at ``mount``) and exits; the job's
    own image and pull policy (``container``), the trainer pods' secure settings."""
    return helper_pod(
        f"{job}-read-",
        job,
        namespace,
        container,
        ["python", "-c", _READ, path, str(MAX_FETCH_BYTES)],
        [{"name": "output", "mountPath": mount, "readOnly": True}],
        [{"name": "output", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
    )


def helper_pod(
    prefix: str,
    job: str,
    namespace: str,
    container: dict[str, Any],
    command: list[str],
    mounts: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
) -> dict[str, Any]:
    """A short-lived pod of the job's image (``container``: image and pull policy) with the
    trainer pods' secure settings: non-root, read-only root, no capabilities, no API token."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": prefix,
            "namespace": namespace,
            "labels": {manifests.LABEL_JOB: job, HELPER_LABEL: "true"},
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": manifests.RUN_AS_USER,
                "runAsGroup": manifests.RUN_AS_USER,
                "fsGroup": manifests.RUN_AS_USER,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "main",
                    "image": container["image"],
                    "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
                    "command": command,
                    "resources": {
                        "requests": {"cpu": "10m", "memory": "64Mi"},
                        "limits": {"cpu": "500m", "memory": "256Mi"},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }


def decode(log: str, where: str) -> bytes:
    """The file a reader pod printed, checked against the size and digest it printed first."""
    head, _, body = log.partition("\n")
    try:
        size_text, digest = head.split()
        size = int(size_text)
    except ValueError:
        raise OSError(
            f"{where}: the reader printed {head[:200]!r}, not a size and digest"
        ) from None
    if size > MAX_FETCH_BYTES:
        raise OSError(
            f"{where} is {size:,} bytes; the client reads at most {MAX_FETCH_BYTES:,} through a "
            "pod's log (the kubelet rotates it at 10 MiB): copy it from the claim with a pod "
            "of your own"
        )
    data = base64.b64decode(body)
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise OSError(f"{where}: read {len(data):,} bytes that do not match its size or SHA-256")
    return data


def run_pod(core: client.CoreV1Api, namespace: str, pod: dict[str, Any], where: str) -> str:
    """Run a short-lived ``pod`` (one container) to its end and return its log; the pod is
    deleted whatever happens. A failed pod raises with its log's tail."""
    name = core.create_namespaced_pod(namespace, pod).metadata.name
    container = pod["spec"]["containers"][0]["name"]
    try:
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while (phase := core.read_namespaced_pod(name, namespace).status.phase) not in (
            "Succeeded",
            "Failed",
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{where}: pod {name} was {phase} after {FETCH_TIMEOUT_S} s")
            time.sleep(0.5)
        log = str(core.read_namespaced_pod_log(name, namespace, container=container))
        if phase == "Failed":
            raise OSError(f"{where}: pod {name} failed: {log[-500:]}")
        return log
    finally:
        with contextlib.suppress(ApiException):  # never hides the first error; owned by the job
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def read(core: client.CoreV1Api, namespace: str, pod: dict[str, Any], where: str) -> bytes:
    """The file a reader ``pod`` (:func:`reader_pod`) prints, checked."""
    return decode(run_pod(core, namespace, pod, where), where)
