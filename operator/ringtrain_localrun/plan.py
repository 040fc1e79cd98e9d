"""Planning: a TrainingJob's Pods → the processes that stand in for them (pure apart from the
port allocator).

Pipeline position: the first step of `ringtrain run`. The manifest goes through
:func:`spec.load` (the CRD's defaults and validation) and :func:`manifests.desired_objects` (the
operator's Pods, TF_CONFIG included), with loopback endpoints on free ports. Each Pod's main
container becomes a :class:`Replica`:

* its command and args, with ``ringtrain`` meaning this interpreter's ``ringtrain.cli`` (so the
  worker runs the code of this checkout, whatever ``PATH`` holds) and ``python``/``python3`` this
  interpreter (the environment `hack/setup` made stands in for the image's: a stock TensorFlow
  script finds the TensorFlow of ``.venv``);
* its env, ``valueFrom`` resolved from the rendered Secret and the Pod's own metadata;
* its volumes made local: a Secret or ConfigMap volume becomes files in a private directory
  (the job's own, or one of the job's file: :mod:`.sources`, spec.trainer.modelFrom), emptyDirs
  per-replica directories, a hostPath the path itself (this machine is the node), any other
  volume (the checkpoint volume) one directory the replicas share, like a PVC. An arg or env
  value under a mount path is rewritten to the local one, but never a path of the user's own
  (:func:`rewrite`, docs/decisions/0200-local-run-paths.md): the pod's scratch mount ``/tmp``
  maps only itself (``HOME``), the interpreter and the checkout are never touched, and a path
  that exists on this machine is the user's file;
* ``--metrics-port`` replaced by a free port, ``--termination-log`` by a file in the run dir;
  its output kept in ``<run dir>/pods/<pod>/log``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringtrain import ports
from ringtrain_operator import admission, manifests, mpi, mpirun, tfjob, yamlsafe
from ringtrain_operator import spec as jobspec

from .paths import PodPaths, inside, secret_data, under_any
from .paths import volume_dirs as map_volumes
from .sources import model_from

#: The Pod volume manifests.pod() mounts at spec.trainer.checkpoint.path.
CHECKPOINT_VOLUME = manifests.CHECKPOINT_VOLUME
#: An MPI job's worker pod locally: on one host mpirun starts every rank itself (its hostfile
#: is ``localhost``), so the workers' sshd has nothing to serve; this idle process stands in
#: for it, as long-lived as sshd and ended by SIGTERM with 0.
SSHD_STAND_IN = (
    sys.executable,
    "-c",
    "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()",
)
#: mpirun's flags on one host: as root too (this machine's tests run as root), and more ranks
#: than cores.
MPIRUN_LOCAL = ("--oversubscribe", *(("--allow-run-as-root",) if os.geteuid() == 0 else ()))


@dataclasses.dataclass(frozen=True)
class Replica:
    """One process to start: what a kubelet would run for one Pod, translated to this machine."""

    name: str  # the Pod name, e.g. "mnist-worker-0"
    role: str  # TF_CONFIG role
    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the Pod's env only; the process also inherits os.environ
    files: Mapping[str, bytes]  # local path → content, written 0600 before the start
    dirs: tuple[str, ...]  # local directories to create before the start
    metrics_port: int | None
    termination_log: str | None
    #: The Pod's restartPolicy: whether a failed process is started again in place.
    restart_policy: str = "Never"
    #: The main container's terminationMessagePolicy: with FallbackToLogsOnError a failure
    #: without a termination log is explained by the tail of its log, as the kubelet does.
    termination_message_policy: str = "File"
    #: Where its output is kept (``<run dir>/pods/<pod>/log``, rotated: :mod:`.logs`).
    log: str | None = None
    #: The in-pod paths of its args and env that were made local: local path → why, e.g.
    #: ``/models/m.keras in the pod (volume models, mounted at /models)``.
    rewritten: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.role}-{self.index}"


def port_allocator() -> Callable[[], int]:
    """A port allocator for one run: each call a loopback port free right now whose
    side-channel port is free too, and neither any port an earlier call handed out or its side
    channel's (ring and metrics ports alike; ``ringtrain.ports``)."""
    taken: set[int] = set()

    def port() -> int:
        (p,) = ports.free_ring_ports(1, taken=taken)
        taken.update(ports.member_ports(p))
        return p

    return port


def loopback_endpoints(port: Callable[[], int]) -> manifests.Endpoint:
    """An ``endpoint`` for :func:`manifests.desired_objects`: one stable loopback port per replica.

    The same (role, index) must get the same address in every replica's TF_CONFIG, so the first
    answer is remembered.
    """
    chosen: dict[tuple[str, int], str] = {}

    def endpoint(job: jobspec.Job, role: str, index: int) -> str:
        if (role, index) not in chosen:
            chosen[(role, index)] = f"127.0.0.1:{port()}"
        return chosen[(role, index)]

    return endpoint


def _field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta.get("namespace", ""),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
        "spec.nodeName": socket.gethostname(),
        "spec.serviceAccountName": "default",
    }
    if path in simple:
        return simple[path]
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return (meta.get(kind) or {}).get(path[len(prefix) : -2], "")
    raise jobspec.InvalidSpec(f"pod {meta['name']}: env fieldRef {path!r} cannot be run locally")


def _env(
    pod: Mapping[str, Any], container: Mapping[str, Any], secrets: Mapping[str, Mapping[str, bytes]]
) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        name = e["name"]
        if "value" in e:
            env[name] = str(e["value"])
            continue
        src = e.get("valueFrom") or {}
        if "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            try:
                env[name] = secrets[ref["name"]][ref["key"]].decode()
            except KeyError:
                if ref.get("optional"):
                    continue
                raise jobspec.InvalidSpec(
                    f"pod {pod['metadata']['name']}: env {name} refers to secret "
                    f"{ref.get('name')}/{ref.get('key')}, which the job does not create"
                ) from None
        elif "fieldRef" in src:
            env[name] = _field_ref(pod, src["fieldRef"]["fieldPath"])
        else:
            raise jobspec.InvalidSpec(
                f"pod {pod['metadata']['name']}: env {name}: only value, secretKeyRef and "
                "fieldRef can be run locally"
            )
    return env


def _set_flag(args: list[str], flag: str, value: str) -> bool:
    """Replace the value of ``flag`` (``--f v`` or ``--f=v``) in place; False if absent."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            args[i + 1] = value
            return True
        if a.startswith(flag + "="):
            args[i] = f"{flag}={value}"
            return True
    return False


def _local_command(command: list[str]) -> list[str]:
    """The image's ENTRYPOINT is ``ringtrain``: run this checkout's CLI with this interpreter."""
    if command and command[0] == "ringtrain":
        return [sys.executable, "-m", "ringtrain.cli", *command[1:]]
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command


def plan(
    obj: Mapping[str, Any],
    run_dir: Path,
    *,
    port: Callable[[], int] | None = None,
    sources: Sequence[Mapping[str, Any]] = (),
) -> tuple[jobspec.Job, list[Replica]]:
    """Load a TrainingJob and translate each of its Pods into a :class:`Replica`.

    ``port`` (default: :func:`port_allocator`) hands out the ring and metrics ports;
    ``sources``: the ConfigMaps and Secrets of the job's file (:func:`.sources.read`), mounted
    where a pod names them (spec.trainer.modelFrom, a template's volumes).
    Raises :class:`jobspec.InvalidSpec` with the offending field for anything that cannot run.
    """
    port = port or port_allocator()
    job = admission.load(obj)  # the operator's spec check, the same refusals
    model_from(job, sources)  # refuses what this machine cannot mount, naming the field
    objs = (
        mpi.desired_objects(job, local=True)
        if job.mpi
        else manifests.desired_objects(job, endpoint=loopback_endpoints(port))
    )
    secrets = secret_data([*sources, *objs])  # the job's own objects win a clash of names
    replicas = []
    for pod in (o for o in objs if o["kind"] == "Pod"):
        labels = pod["metadata"]["labels"]
        role, index = labels[manifests.LABEL_ROLE], int(labels[manifests.LABEL_INDEX])
        containers = pod["spec"].get("containers") or []
        container = next(
            (c for c in containers if c.get("name") == manifests.MAIN_CONTAINER), containers[0]
        )
        others = [c["name"] for c in containers if c is not container]
        if others:
            raise jobspec.InvalidSpec(
                f"pod {pod['metadata']['name']}: sidecar containers {others} cannot be run locally"
            )
        command = list(container.get("command") or [])
        args = list(container.get("args") or [])
        if job.mpi and role == "worker":
            command, args = list(SSHD_STAND_IN), []
        elif job.mpi and role == "launcher" and (program := mpirun.rank_command(job, True)):
            # rank 0's output alone reaches the supervisor; rank 0 writes its own result
            full = mpirun.mpirun_command(job, True, _local_command(program))
            command = [*_local_command(list(mpirun.LAUNCH)), "--no-termination-log", full[0]]
            args = [*MPIRUN_LOCAL, *full[1:]]  # args: paths made local below
        if not command:
            if not str(container.get("image", "")).split("/")[-1].startswith("ringtrain"):
                raise jobspec.InvalidSpec(
                    f"pod {pod['metadata']['name']}: container {container['name']} has no "
                    "command; locally there is no image ENTRYPOINT to fall back on"
                )
            command = ["ringtrain"]  # the ringtrain image's ENTRYPOINT
        volume_dirs, files = map_volumes(pod, run_dir, secrets)
        host_paths = [
            volume_dirs[v["name"]]
            for v in pod["spec"].get("volumes") or []
            if "hostPath" in v and v["name"] != CHECKPOINT_VOLUME
        ]
        mounts: dict[str, Path] = {}
        volume_of: dict[str, str] = {}
        for m in container.get("volumeMounts") or []:
            local = volume_dirs[m["name"]]
            mounts[m["mountPath"]] = local / m["subPath"] if m.get("subPath") else local
            volume_of[m["mountPath"]] = m["name"]
        declared = {
            v["name"]
            for r in job.replicas
            if r.role == role
            for v in (r.template.get("spec") or {}).get("volumes") or []
        }
        user_mounts = {path for path, name in volume_of.items() if name in declared}
        paths = PodPaths(mounts, volume_of, user_mounts, run_dir)
        env = {k: paths.local(v) for k, v in _env(pod, container, secrets).items()}
        args = [paths.local(a) for a in args]
        if job.trainer is not None:
            _check_model(job.trainer.model, paths.local, run_dir)
        metrics_port = None
        if any(p.get("name") == "metrics" for p in container.get("ports") or []) and not (
            job.mpi and role == "worker"  # the stand-in serves nothing
        ):
            metrics_port = port()
            _set_flag(args, "--metrics-port", str(metrics_port))
        termination_log = None
        if _set_flag(
            args,
            "--termination-log",
            str(run_dir / "pods" / pod["metadata"]["name"] / "termination-log"),
        ):
            termination_log = str(run_dir / "pods" / pod["metadata"]["name"] / "termination-log")
        replicas.append(
            Replica(
                name=pod["metadata"]["name"],
                role=role,
                index=index,
                argv=tuple(_local_command(command) + args),
                env=env,
                files=files,
                dirs=tuple(
                    sorted(
                        {
                            str(d)
                            for d in [
                                *volume_dirs.values(),
                                *mounts.values(),
                                run_dir / "pods" / pod["metadata"]["name"],
                            ]
                            if not under_any(d, host_paths)
                        }
                    )
                ),
                metrics_port=metrics_port,
                termination_log=termination_log,
                restart_policy=pod["spec"].get("restartPolicy", "Always"),
                termination_message_policy=container.get("terminationMessagePolicy", "File"),
                log=str(run_dir / "pods" / pod["metadata"]["name"] / "log"),
                rewritten=paths.rewritten,
            )
        )
    return job, replicas


def _check_model(model: Any, local_path: Callable[[str], str], run_dir: Path) -> None:
    """spec.trainer.model naming a file that is not there: refused before anything starts,
    naming the path looked up and why there (a file in a volume of the run dir may be written
    by then, so only a path outside it is checked)."""
    if not isinstance(model, str) or not model.startswith("/"):
        return
    local = local_path(model)
    if inside(local, str(run_dir)) or os.path.isfile(local):
        return
    where = (
        f"{local}, where {model} in the pod is on this machine"
        if local != model
        else f"{model} on this machine (ringtrain run reads a path outside the pod's volumes "
        "as this machine's own)"
    )
    raise jobspec.InvalidSpec(f"spec.trainer.model: no such file: looked up {where}")


def read_job(path: str) -> dict:
    """The single TrainingJob in a YAML file (other kinds in a multi-document file are ignored),
    or a Kubeflow TFJob converted to one (``ringtrain_operator.tfjob``), saying so."""
    try:
        with open(path) as f:
            docs = [d for d in yamlsafe.load_all(f, path) if d]
    except OSError as e:
        raise jobspec.InvalidSpec(f"{path}: {e.strerror}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == jobspec.KIND]
    tfjobs = [d for d in docs if tfjob.is_tfjob(d)]
    if not jobs and len(tfjobs) == 1:
        job, notes = tfjob.convert(tfjobs[0])
        print(f"ringtrain run: {path}: converted: {'; '.join(notes)}", file=sys.stderr)
        return job
    if len(jobs) != 1:
        raise jobspec.InvalidSpec(
            f"{path}: expected exactly one {jobspec.KIND} document, found {len(jobs)}"
        )
    return jobs[0]
