"""MPI jobs (``spec.mpi``): spec → Kubernetes objects, as mpi-operator's MPIJob lays them out.

One Launcher pod runs ``mpirun`` against N Worker pods that run ``sshd``; the ranks are started
by Open MPI's daemons over SSH inside the worker pods (their checkpoint and data volumes), so no
TF_CONFIG and no ring token: the hostfile and ``OMPI_*`` are what a rank gets, as the seeds'
``mpirun -np 2 -H localhost:2 python train.py`` gives it. Per job the operator makes:

- a Secret of type ``kubernetes.io/ssh-auth`` with a fresh Ed25519 key pair (generated here,
  created once like the ring Secret: a 409 drops the new key unseen), mounted 0400 at
  ``sshAuthMountPath`` in every pod as the key, its ``.pub`` and ``authorized_keys``: a job's
  workers accept only their own launcher's key;
- a ConfigMap with the hostfile (``<pod>.<svc>.<ns>.svc slots=<n>``) and sshd's configuration;
- workers whose sshd runs as the image's non-root user on :data:`SSHD_PORT` (no capabilities,
  read-only root filesystem: the host key is made at start into an emptyDir), ready once it
  accepts connections;
- a launcher with ``mpirun`` and Open MPI's MCA settings in its environment (hostfile, ssh
  port and key, fixed TCP port ranges for :func:`network_policy`), created under
  ``WaitForWorkersReady`` only once every worker is ready (:func:`launcher_wait`): mpi-operator's
  ``AtStartup`` default is what gives its users "Could not resolve hostname" crash loops.

The pods are the ring job's (:func:`.manifests.pod`: the template layered under ringtrain's
security defaults, the trainer's volumes) with the ring's parts taken out and MPI's put in.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ringtrain.errors import InvalidSpec

from . import manifests, modelfrom, scanskips
from .job import Job, MPISpec, ReplicaSpec, TrainerSpec
from .mpirun import (
    BTL_PORT_MIN,
    KEY_FILE,
    LAUNCH,
    MPI_CONFIG_DIR,
    OOB_PORT_MIN,
    PORT_RANGE,
    SSHD_PORT,
    hostfile,
    launcher_env,
    mpi_spec,
    mpirun_command,
    workers,
)
from .networkpolicy import Settings
from .networkpolicy import network_policy as ring_network_policy
from .observe import ObservedPod

SSHD_CONFIG = f"{MPI_CONFIG_DIR}/sshd_config"
#: sshd's host key and pid file: an emptyDir (the root filesystem is read-only).
SSHD_RUN_DIR = "/var/run/ringtrain-sshd"
SSH_VOLUME, CONFIG_VOLUME, SSHD_VOLUME = "ssh-auth", "mpi-config", "sshd-run"
#: mpi-operator's Secret keys for type kubernetes.io/ssh-auth.
PRIVATE_KEY, PUBLIC_KEY = "ssh-privatekey", "ssh-publickey"
LAUNCHER = "launcher"
REASON_WAITING = "WaitingForWorkersReady"

#: The worker's main container: a host key for this pod, then sshd in the foreground.
SSHD_SCRIPT = (
    f'set -e; ssh-keygen -q -t ed25519 -N "" -f {SSHD_RUN_DIR}/host_ed25519_key; '
    f"exec /usr/sbin/sshd -D -e -f {SSHD_CONFIG}"
)
#: What the ring job's pod has that an MPI pod must not: TF_CONFIG, the ring token, its ports.
_RING_ENV = ("TF_CONFIG", "RINGTRAIN_TOKEN_FILE", "RINGTRAIN_TLS_DIR")
_RING_PORTS = ("ring", "ring-data", "health")
_RING_VOLUMES = ("ring-token",)


def check(m: MPISpec, replicas: tuple[ReplicaSpec, ...], trainer: TrainerSpec | None) -> None:
    """What an MPI job cannot have, naming the field: an MPI job's ranks are its workers."""
    by_role = {r.role: r for r in replicas}
    for key in ("Chief", "PS", "Evaluator"):
        if key.lower() in by_role:
            raise InvalidSpec(
                f"spec.replicaSpecs.{key}: an MPI job (spec.mpi) is one Launcher and its "
                "Workers; MPI's ranks are the Worker pods' processes (rank 0 on worker 0), "
                f"there is no {key.lower()}. Remove it, or remove spec.mpi for a ring job"
            )
    if m.command is not None and trainer is not None:
        raise InvalidSpec(
            "spec.mpi.command: it replaces the built-in trainer's ranks, so spec.trainer would "
            "not run; remove spec.trainer (and give the image in the templates) or "
            "spec.mpi.command"
        )
    worker = by_role.get("worker")
    if worker is not None and any(c.get("command") for c in _containers(worker)):
        raise InvalidSpec(
            "spec.replicaSpecs.Worker.template.spec.containers[].command: an MPI job's workers "
            "run sshd, and mpirun starts the ranks in them; put the rank program in "
            "spec.mpi.command"
        )
    launcher = by_role[LAUNCHER]
    if (
        trainer is None
        and m.command is None
        and not any(c.get("command") for c in _containers(launcher))
    ):
        raise InvalidSpec(
            "spec.mpi.command: required without spec.trainer, unless the Launcher template's "
            "container has its own command (mpirun ...)"
        )


def _containers(r: ReplicaSpec) -> list[Mapping[str, Any]]:
    spec = r.template.get("spec") if isinstance(r.template, Mapping) else None
    cs = spec.get("containers") if isinstance(spec, Mapping) else None
    return [c for c in cs if isinstance(c, Mapping)] if isinstance(cs, list) else []


def secret_name(job: Job) -> str:
    return f"{job.name}-ssh"


def config_map_name(job: Job) -> str:
    return f"{job.name}-mpi"


def ssh_key_pair() -> tuple[bytes, bytes]:
    """A fresh Ed25519 key pair: (private key in OpenSSH's format, ``ssh-ed25519 ...`` line)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public + b"\n"


def ssh_secret(job: Job, key_pair: tuple[bytes, bytes] | None = None) -> dict:
    """The job's SSH key pair (fresh unless given), as mpi-operator stores it."""
    private, public = key_pair if key_pair is not None else ssh_key_pair()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, secret_name(job)),
        "type": "kubernetes.io/ssh-auth",
        "data": {
            PRIVATE_KEY: base64.b64encode(private).decode(),
            PUBLIC_KEY: base64.b64encode(public).decode(),
        },
    }


def _metadata(job: Job, name: str) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": manifests.labels(job),
    }
    if refs := manifests.owner_references(job):
        meta["ownerReferences"] = refs
    return meta


def sshd_config(job: Job, port: int = SSHD_PORT, run_dir: str = SSHD_RUN_DIR) -> str:
    """sshd as the image's user: key logins with the job's key only, no forwarding, no PAM
    (it needs root). StrictModes is off because a Secret volume's directory is the kubelet's
    (root-owned, sticky); the key files themselves are 0400 plus the pod's fsGroup read.
    ``port`` and ``run_dir`` are the pod's; a test on one host gives its own."""
    auth = mpi_spec(job).ssh_auth_mount_path.rstrip("/")
    return "\n".join(
        [
            f"Port {port}",
            f"HostKey {run_dir}/host_ed25519_key",
            f"PidFile {run_dir}/sshd.pid",
            f"AuthorizedKeysFile {auth}/authorized_keys",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitUserEnvironment no",
            "AllowTcpForwarding no",
            "AllowAgentForwarding no",
            "X11Forwarding no",
            "PermitTunnel no",
            "PrintMotd no",
            "",
        ]
    )


def config_map(job: Job, local: bool = False) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job)),
        "data": {"hostfile": hostfile(job, local), "sshd_config": sshd_config(job)},
    }


def service(job: Job) -> dict:
    """The ring job's headless Service (workers' DNS names before readiness), sshd's port."""
    svc = manifests.service(job)
    svc["spec"]["ports"] = [
        {"name": "ssh", "port": SSHD_PORT, "targetPort": SSHD_PORT, "protocol": "TCP"}
    ]
    return svc


def _main(pod_obj: dict) -> dict:
    cs = pod_obj["spec"]["containers"]
    return next((c for c in cs if c.get("name") == manifests.MAIN_CONTAINER), cs[0])


def _without_ring(pod_obj: dict) -> dict:
    """The ring job's pod less the ring: its env, ports, token volume and probes."""
    spec = pod_obj["spec"]
    main = _main(pod_obj)
    main["env"] = [e for e in main.get("env", []) if e["name"] not in _RING_ENV]
    main["ports"] = [p for p in main.get("ports", []) if p.get("name") not in _RING_PORTS]
    main["volumeMounts"] = [m for m in main["volumeMounts"] if m["name"] not in _RING_VOLUMES]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in _RING_VOLUMES]
    ring_probes = manifests.worker_probes(manifests.probe_form())
    for kind, probe in ring_probes.items():
        if main.get(kind) == probe:
            del main[kind]
    main.pop("args", None)
    return pod_obj


def ssh_volume_items() -> list[dict]:
    """The Secret volume's layout: the private key, its ``.pub`` and ``authorized_keys``."""
    return [
        {"key": PRIVATE_KEY, "path": KEY_FILE},
        {"key": PUBLIC_KEY, "path": f"{KEY_FILE}.pub"},
        {"key": PUBLIC_KEY, "path": "authorized_keys"},
    ]


def _ssh_volume(job: Job) -> tuple[dict, dict]:
    """The key pair as ``id_ed25519``, its ``.pub`` and ``authorized_keys``, mode 0400."""
    volume = {
        "name": SSH_VOLUME,
        "secret": {
            "secretName": secret_name(job),
            "defaultMode": manifests.TOKEN_MODE,
            "items": ssh_volume_items(),
        },
    }
    mount = {"name": SSH_VOLUME, "mountPath": mpi_spec(job).ssh_auth_mount_path, "readOnly": True}
    return volume, mount


def _add(pod_obj: dict, volumes: list[dict], mounts: list[dict], env: list[dict]) -> None:
    main = _main(pod_obj)
    pod_obj["spec"]["volumes"] = manifests._merge_named(pod_obj["spec"]["volumes"], volumes)
    main["volumeMounts"] = manifests._merge_named(main["volumeMounts"], mounts)
    main["env"] = manifests._merge_named(main.get("env") or [], env)


def worker_pod(job: Job, replica: ReplicaSpec, index: int) -> dict:
    """A worker: sshd in the main container, where the ranks then run (checkpoint and data
    volumes mounted as in a ring worker's pod); ready once sshd accepts connections."""
    p = _without_ring(manifests.pod(job, replica, index))
    main = _main(p)
    ssh_volume, ssh_mount = _ssh_volume(job)
    config = {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job)}}
    _add(
        p,
        [ssh_volume, config, {"name": SSHD_VOLUME, "emptyDir": {"medium": "Memory"}}],
        [
            ssh_mount,
            {"name": CONFIG_VOLUME, "mountPath": MPI_CONFIG_DIR, "readOnly": True},
            {"name": SSHD_VOLUME, "mountPath": SSHD_RUN_DIR},
        ],
        [],
    )
    main["command"] = ["/bin/sh", "-c", SSHD_SCRIPT]
    main["ports"] = manifests._merge_named(
        main["ports"], [{"name": "ssh", "containerPort": SSHD_PORT, "protocol": "TCP"}]
    )
    main["readinessProbe"] = {
        "tcpSocket": {"port": SSHD_PORT},
        "periodSeconds": 2,
        "failureThreshold": 3,
    }
    # an sshd that stops accepting is restarted, as a ring worker whose health port stops is
    main.setdefault(
        "livenessProbe",
        {
            "tcpSocket": {"port": SSHD_PORT},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    )
    return p


def launcher_pod(job: Job, replica: ReplicaSpec, local: bool = False) -> dict:
    """The launcher: ``mpirun`` (or the template's own command) with Open MPI's settings and
    the job's key; the hostfile from the ConfigMap. It serves nothing: no ports, no probes
    (their scanner exceptions written on it, :data:`.scanskips.LAUNCHER`).
    ``local`` (``ringtrain run``): the ranks run under the launcher's own process, so it keeps
    the trainer's volumes."""
    p = _without_ring(manifests.pod(job, replica, 0))
    main = _main(p)
    ssh_volume, ssh_mount = _ssh_volume(job)
    config = {
        "name": CONFIG_VOLUME,
        "configMap": {
            "name": config_map_name(job),
            "items": [{"key": "hostfile", "path": "hostfile"}],
        },
    }
    _add(
        p,
        [ssh_volume, config],
        [ssh_mount, {"name": CONFIG_VOLUME, "mountPath": MPI_CONFIG_DIR, "readOnly": True}],
        launcher_env(job, local),
    )
    main["ports"] = [q for q in main["ports"] if q.get("name") != "metrics"]
    if not main["ports"]:
        del main["ports"]
    annotations = p["metadata"].get("annotations") or {}
    for k in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
        annotations.pop(k, None)
    p["metadata"]["annotations"] = scanskips.with_skips(annotations, scanskips.LAUNCHER)
    if command := mpirun_command(job, local):
        # the built-in trainer's rank 0 result becomes the launcher's termination message
        main["command"] = [*LAUNCH, *command] if job.trainer and not local else command
    # the launcher neither trains nor checkpoints: it needs no checkpoint, data or model volume
    drop = (
        (manifests.CHECKPOINT_VOLUME, manifests.DATA_VOLUME, modelfrom.VOLUME)
        if job.trainer and not local
        else ()
    )
    main["volumeMounts"] = [m for m in main["volumeMounts"] if m["name"] not in drop]
    p["spec"]["volumes"] = [v for v in p["spec"]["volumes"] if v["name"] not in drop]
    return p


def pod(job: Job, replica: ReplicaSpec, index: int, local: bool = False) -> dict:
    if replica.role == LAUNCHER:
        return launcher_pod(job, replica, local)
    return worker_pod(job, replica, index)


def pods(job: Job, local: bool = False) -> list[dict]:
    return [pod(job, r, i, local) for r, i in job.members()]


def job_objects(
    job: Job, key_pair: tuple[bytes, bytes] | None = None, local: bool = False
) -> list[dict]:
    """What the job's pods need before they start: Service, SSH Secret, ConfigMap."""
    return [service(job), ssh_secret(job, key_pair), config_map(job, local)]


def desired_objects(
    job: Job, key_pair: tuple[bytes, bytes] | None = None, local: bool = False
) -> list[dict]:
    """Everything the operator creates for an MPI job, pods last (workers, then launcher);
    ``local``: as ``ringtrain run`` runs it on one host (:func:`hostfile`)."""
    return [*job_objects(job, key_pair, local), *pods(job, local)]


def launcher_wait(job: Job, live: Mapping[str, ObservedPod]) -> str | None:
    """Why the launcher is not created yet (the workers it waits for), or None: it may be.
    Under WaitForWorkersReady it waits until every worker is ready (its sshd answers)."""
    if job.mpi is None or job.mpi.launcher_creation_policy != "WaitForWorkersReady":
        return None
    names = [job.pod_name("worker", i) for i in range(workers(job))]
    waiting = [n for n in names if n not in live or not live[n].ready]
    if not waiting:
        return None
    return f"the launcher waits for the workers' sshd (WaitForWorkersReady): {', '.join(waiting)}"


def network_policy(job: Job, settings: Settings) -> dict:
    """The ring job's policy (metrics from Prometheus and the operator) with MPI's ports:
    sshd only from the launcher, Open MPI's TCP ranges only between the job's pods."""
    out = ring_network_policy(job, settings)
    same_job = {"podSelector": {"matchLabels": manifests.labels(job)}}
    launcher = {"podSelector": {"matchLabels": manifests.labels(job, LAUNCHER, 0)}}
    ranges = [
        {"protocol": "TCP", "port": lo, "endPort": lo + PORT_RANGE - 1}
        for lo in (BTL_PORT_MIN, OOB_PORT_MIN)
    ]
    rules = [r for r in out["spec"]["ingress"] if r["from"] != [same_job]]
    out["spec"]["ingress"] = [
        {"from": [launcher], "ports": [{"protocol": "TCP", "port": SSHD_PORT}]},
        {"from": [copy.deepcopy(same_job)], "ports": ranges},
        *rules,
    ]
    return out
