"""Spec → Kubernetes objects: the headless Service, the ring Secret and one Pod per replica.

Pure functions of a :class:`~ringtrain_operator.spec.Job`: the operator creates what they return,
``ringtrain render`` prints it, and ``ringtrain run`` starts each Pod's main container as a local
process with loopback addresses (hence the injectable ``endpoint``). A Pod's command, args and env
are therefore complete: nothing is filled in later by the operator or read from the API.
"""

from __future__ import annotations

import base64
import copy
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from ringtrain import cluster, optiongen, options, pki, ports

from . import elastic, modelfrom, resources
from .job import API_VERSION, KIND, Job, ReplicaSpec, TrainerSpec

#: The worker's gRPC server: ring control plane, Health service, the ``grpc`` data path.
RING_PORT = 2222
#: The ``grpc+tcp`` data path's raw TCP side channel (announced over RING_PORT as well).
RING_DATA_PORT = ports.side_channel_port(RING_PORT)
#: The Health service alone, in plaintext, for the kubelet's gRPC probe (which speaks no TLS:
#: the ring port is mutual TLS); only with the grpc probe form.
HEALTH_PORT = RING_PORT + 2
METRICS_PORT = 9400
#: How trainer pods are probed (the operator's environment; the chart's operator.workerProbe):
#: exec runs ``ringtrain health`` (any cluster), grpc uses the kubelet's gRPC probe of the
#: same Health service (Kubernetes >= 1.24), none leaves them out.
PROBE_ENV = "RINGTRAIN_WORKER_PROBE"
PROBE_FORMS = ("exec", "grpc", "none")
#: The container that runs the trainer (or the user's command) and gets TF_CONFIG.
MAIN_CONTAINER = "ringtrain"
TERMINATION_LOG = options.TERMINATION_LOG
TOKEN_KEY = "token"
TOKEN_DIR = "/var/run/ringtrain/ring-token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
#: The job's TLS material (ca.crt, tls.crt, tls.key) sits beside the token in the same Secret.
TLS_DIR = TOKEN_DIR
RUN_AS_USER = 10001
#: The Secret's files' mode (token and TLS material): owner-read only (Kubeflow #3262 shipped
#: 0644). With the pod's fsGroup the kubelet adds group read (0440, group RUN_AS_USER), so the
#: non-root trainer can read it; never world-readable.
TOKEN_MODE = 0o400

LABEL_JOB = "ringtrain.io/job-name"
LABEL_ROLE = "ringtrain.io/replica-type"
LABEL_INDEX = "ringtrain.io/replica-index"

#: The Pod restartPolicy for each replica restartPolicy. ExitCode restarts in place too (the
#: kubelet keeps the pod and its emptyDirs); the operator fails the job on a permanent code.
POD_RESTART_POLICY = {
    "Never": "Never",
    "ExitCode": "OnFailure",
    "OnFailure": "OnFailure",
    "Always": "Always",
}

Endpoint = Callable[[Job, str, int], str]


def dns_endpoint(job: Job, role: str, index: int) -> str:
    """The stable in-cluster address of a replica: its host name under the headless Service."""
    return f"{job.pod_name(role, index)}.{job.service_name}.{job.namespace}.svc:{RING_PORT}"


def secret_name(job: Job) -> str:
    return f"{job.name}-ring-token"


def labels(job: Job, role: str | None = None, index: int | None = None) -> dict[str, str]:
    out = {LABEL_JOB: job.name}
    if role is not None:
        out[LABEL_ROLE] = role
    if index is not None:
        out[LABEL_INDEX] = str(index)
    return out


def tf_config(job: Job, role: str, index: int, endpoint: Endpoint = dns_endpoint) -> str:
    """TF_CONFIG of one replica, serialised by the trainer's own ``cluster.build``."""
    addresses = {
        r.role: [endpoint(job, r.role, i) for i in range(r.replicas)] for r in job.replicas
    }
    return cluster.build(addresses, role, index)


#: The Pod volumes of spec.trainer: the checkpoint volume and the user's data volume.
CHECKPOINT_VOLUME = "checkpoints"
DATA_VOLUME = "data"


def data_path(t: TrainerSpec) -> str | None:
    """Where the worker reads spec.trainer.data in the pod (``--data``); None without it."""
    if not t.data_volume:
        return None
    mount = t.data_mount_path or "/data"
    return f"{mount.rstrip('/')}/{t.data_file}" if t.data_file else mount


def trainer_args(t: TrainerSpec) -> list[str]:
    """``ringtrain worker`` flags for spec.trainer, and the ones every trainer pod gets.
    spec.trainer.data, when set, takes the place of dataDir."""
    values = {o.name: getattr(t, o.name) for o in options.CRD}
    if (path := data_path(t)) is not None:
        values["data_dir"] = path
    return optiongen.worker_args(
        {**values, "metrics_port": METRICS_PORT, "json": True, "termination_log": TERMINATION_LOG}
    )


def owner_references(job: Job) -> list[dict]:
    """Ties children to the TrainingJob so the garbage collector removes them with it."""
    if not job.uid:  # rendering a file that was never created: nothing to own yet
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": job.name,
            "uid": job.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def controller_ref(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's controller: its ownerReference with ``controller: true``, or None."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    for ref in refs if isinstance(refs, list) else ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller, or None: the one owner whose objects the operator
    adopts (Kubernetes' ``IsControlledBy``)."""
    uid = (controller_ref(obj) or {}).get("uid")
    return uid if isinstance(uid, str) else None


def _metadata(job: Job, name: str, extra_labels: Mapping[str, str]) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace, "labels": dict(extra_labels)}
    if refs := owner_references(job):
        meta["ownerReferences"] = refs
    return meta


def service(job: Job) -> dict:
    """Headless, publishing not-ready addresses: every pod's DNS name exists before readiness."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.service_name, labels(job)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(job),
            "ports": [
                {"name": "ring", "port": RING_PORT, "targetPort": RING_PORT, "protocol": "TCP"},
                {
                    "name": "ring-data",
                    "port": RING_DATA_PORT,
                    "targetPort": RING_DATA_PORT,
                    "protocol": "TCP",
                },
            ],
        },
    }


def tls_material(job: Job) -> pki.JobMaterial:
    """A fresh CA and certificate for the job (``ringtrain.pki``; about 4 ms)."""
    return pki.create(job.name, job.namespace, job.service_name, job.uid)


def secret(job: Job, token: str | None = None, material: pki.JobMaterial | None = None) -> dict:
    """The job's ring token and TLS material (``ca.crt``, ``tls.crt``, ``tls.key``); random
    unless given. Created once: the first one stored wins (a create that meets it, 409, drops
    the fresh material unseen), so restarts and reconciles never rotate a running job's keys."""
    token = token if token is not None else secrets.token_urlsafe(32)
    material = material if material is not None else tls_material(job)
    data = {TOKEN_KEY: token.encode(), **material.files()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, secret_name(job), labels(job)),
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def _merge_named(existing: list[dict], ours: list[dict], key: str = "name") -> list[dict]:
    """Ours replace entries of the same name; the template's others are kept, in order."""
    names = {o[key] for o in ours}
    return [e for e in existing if e.get(key) not in names] + ours


def _secure_container(c: dict) -> None:
    sc = c.setdefault("securityContext", {})
    sc.setdefault("allowPrivilegeEscalation", False)
    sc.setdefault("readOnlyRootFilesystem", True)
    sc.setdefault("capabilities", {"drop": ["ALL"]})


def _main_container(containers: list[dict]) -> dict:
    for c in containers:
        if c.get("name") == MAIN_CONTAINER:
            return c
    if containers:
        return containers[0]
    containers.append({"name": MAIN_CONTAINER})
    return containers[0]


def pod(job: Job, replica: ReplicaSpec, index: int, endpoint: Endpoint = dns_endpoint) -> dict:
    """One replica's Pod: the template with ringtrain's settings layered on top.

    The template's own security settings win over the secure defaults (a template may tighten
    or, for an image that needs it, relax them); TF_CONFIG, the token, ports and, with
    spec.trainer, the command are always ringtrain's.
    """
    template = copy.deepcopy(dict(replica.template))
    tmeta = template.get("metadata") or {}
    spec: dict[str, Any] = template.get("spec") or {}
    role = replica.role
    name = job.pod_name(role, index)

    meta = _metadata(job, name, {**(tmeta.get("labels") or {}), **labels(job, role, index)})
    annotations = dict(tmeta.get("annotations") or {})
    if job.trainer:
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(METRICS_PORT),
                "prometheus.io/path": "/metrics",
            }
        )
    elastic_parts = None
    if job.elastic is not None and job.trainer and role == "worker":
        annotations[elastic.ANNOTATION] = elastic.size_document(
            job, tf_config(job, role, index, endpoint)
        )
        elastic_parts = elastic.pod_parts()
    if annotations:
        meta["annotations"] = annotations

    spec["hostname"] = name
    spec["subdomain"] = job.service_name
    spec["restartPolicy"] = POD_RESTART_POLICY[replica.restart_policy]
    spec.setdefault("automountServiceAccountToken", False)  # pods need no API access
    spec.setdefault("enableServiceLinks", False)
    psc = spec.setdefault("securityContext", {})
    psc.setdefault("runAsNonRoot", True)
    psc.setdefault("runAsUser", RUN_AS_USER)
    psc.setdefault("runAsGroup", RUN_AS_USER)
    psc.setdefault("fsGroup", RUN_AS_USER)
    psc.setdefault("seccompProfile", {"type": "RuntimeDefault"})

    volumes = [
        {"name": "tmp", "emptyDir": {}},
        {
            "name": "ring-token",
            "secret": {"secretName": secret_name(job), "defaultMode": TOKEN_MODE},
        },
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "ring-token", "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    env = [
        {"name": "TF_CONFIG", "value": tf_config(job, role, index, endpoint)},
        {"name": "RINGTRAIN_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "RINGTRAIN_TLS_DIR", "value": TLS_DIR},
    ]
    ports: list[dict[str, Any]] = [{"name": "ring", "containerPort": RING_PORT, "protocol": "TCP"}]
    if elastic_parts is not None:
        volumes.append(elastic_parts[0])
        mounts.append(elastic_parts[1])
        env.append(elastic_parts[2])

    containers = spec.setdefault("containers", [])
    main = _main_container(containers)
    if job.trainer:
        t = job.trainer
        volumes.append({"name": CHECKPOINT_VOLUME, **dict(t.checkpoint_volume or {"emptyDir": {}})})
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": t.checkpoint_dir})
        if t.data_volume:
            volumes.append({"name": DATA_VOLUME, **dict(t.data_volume)})
            mounts.append(
                {"name": DATA_VOLUME, "mountPath": t.data_mount_path or "/data", "readOnly": True}
            )
        if t.model_from:  # spec.trainer.modelFrom: --model is the file in it (spec.load)
            volumes.append(modelfrom.volume(t.model_from))
            mounts.append(modelfrom.mount())
        env += [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
        ports.append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
        main.setdefault("image", job.trainer.image)
        resources.apply(main, t)  # from the memory plan, unless the template set them
        main["command"] = ["ringtrain", "worker"]
        main["args"] = trainer_args(job.trainer)
        if _ring_size(job) > 1 and getattr(t, "collective", "ring") == "ring":
            ports.append({"name": "ring-data", "containerPort": RING_DATA_PORT, "protocol": "TCP"})
            form = probe_form()
            if form == "grpc":
                main["args"] += ["--ring-health-port", str(HEALTH_PORT)]
                ports.append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
            for kind, probe in worker_probes(form).items():
                main.setdefault(kind, probe)
    main["env"] = _merge_named(main.get("env") or [], env)
    main["ports"] = _merge_named(main.get("ports") or [], ports)
    main["volumeMounts"] = _merge_named(main.get("volumeMounts") or [], mounts)
    main["terminationMessagePath"] = TERMINATION_LOG
    # a failure that wrote no termination log (a user's script) still says why: the kubelet
    # takes the log's tail; a template's own policy is kept
    main.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    spec["volumes"] = _merge_named(spec.get("volumes") or [], volumes)
    for c in containers + spec.get("initContainers", []):
        _secure_container(c)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _ring_size(job: Job) -> int:
    """The ring's members, or the most an elastic job may grow to."""
    n = sum(1 for r, _ in job.members() if r.role in cluster.RING_ROLES)
    return max(n, job.elastic.max_replicas) if job.elastic else n


def probe_form(env: Mapping[str, str] | None = None) -> str:
    """The probe form the operator was configured with (exec unless told otherwise)."""
    form = (os.environ if env is None else env).get(PROBE_ENV, "exec") or "exec"
    if form not in PROBE_FORMS:
        raise ValueError(f"{PROBE_ENV}={form!r}: choose one of {PROBE_FORMS}")
    return form


def worker_probes(form: str) -> dict[str, dict]:
    """Readiness and liveness probes of a ring worker, both on its gRPC Health service: ready
    once its server serves (peers can register), restarted when it stops answering (a frozen
    process). The exec form runs ``ringtrain health`` in the container for clusters without
    gRPC probes (before 1.24, such as the 1.20 test cluster)."""
    if form == "none":
        return {}
    if form == "grpc":
        check: dict[str, Any] = {"grpc": {"port": HEALTH_PORT}}
    else:
        check = {
            "exec": {
                "command": [
                    "ringtrain",
                    "health",
                    "--address",
                    f"127.0.0.1:{RING_PORT}",
                    "--timeout-s",
                    "4",
                ]
            }
        }
    return {
        "readinessProbe": {
            **copy.deepcopy(check),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            **copy.deepcopy(check),
            "initialDelaySeconds": 30,
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
    }


def pods(job: Job, endpoint: Endpoint = dns_endpoint) -> list[dict]:
    return [pod(job, r, i, endpoint) for r, i in job.members()]


def desired_objects(
    job: Job,
    *,
    endpoint: Endpoint = dns_endpoint,
    token: str | None = None,
    material: pki.JobMaterial | None = None,
) -> list[dict]:
    """Everything the operator creates for a job: Service, Secret, then Pods in TF_CONFIG order."""
    return [service(job), secret(job, token, material), *pods(job, endpoint)]
