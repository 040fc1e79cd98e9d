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
* its volumes made local: the Secret volume becomes files in a private directory, emptyDirs
  per-replica directories, a hostPath the path itself (this machine is the node), any other
  volume (the checkpoint volume) one directory the replicas share, like a PVC. An arg or env
  value under a mount path is rewritten to the local one, but never a path of the user's own
  (:func:`_rewrite`, docs/decisions/0200-local-run-paths.md): the pod's scratch mount ``/tmp``
  maps only itself (``HOME``), the interpreter and the checkout are never touched, and a path
  that exists on this machine is the user's file;
* ``--metrics-port`` replaced by a free port, ``--termination-log`` by a file in the run dir;
  its output kept in ``<run dir>/pods/<pod>/log``.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ringtrain import ports
from ringtrain_operator import manifests, mpi, mpirun, yamlsafe
from ringtrain_operator import spec as jobspec

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
#: The pod's scratch space (manifests.pod mounts an emptyDir there: the root filesystem is
#: read-only). Locally it maps only itself (``HOME=/tmp``): below it is this machine's ``/tmp``,
#: where users keep checkouts and models (issue 34).
SCRATCH_MOUNT = "/tmp"
#: Paths no argument is ever rewritten under, wherever they are: the interpreter's environment
#: and this checkout (an MPI launcher's args name the interpreter of the ranks).
NEVER_REWRITTEN = tuple(
    dict.fromkeys(
        str(p)
        for p in (
            Path(sys.executable).parent,
            Path(sys.prefix),
            Path(__file__).resolve().parents[2],
        )
    )
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


def _secret_data(objs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, bytes]]:
    """Secrets and ConfigMaps by kind and name: their files, as the kubelet writes them."""
    out: dict[str, dict[str, bytes]] = {}
    for o in objs:
        if o.get("kind") == "Secret":
            data = {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            data.update({k: v.encode() for k, v in (o.get("stringData") or {}).items()})
            out[o["metadata"]["name"]] = data
        elif o.get("kind") == "ConfigMap":
            data = {k: v.encode() for k, v in (o.get("data") or {}).items()}
            out[f"configmap/{o['metadata']['name']}"] = data
    return out


def _items(source: Mapping[str, Any], data: Mapping[str, bytes]) -> dict[str, bytes]:
    """A Secret or ConfigMap volume's files: every key, or only its ``items`` at their paths."""
    if not source.get("items"):
        return dict(data)
    return {i["path"]: data[i["key"]] for i in source["items"] if i["key"] in data}


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


def _volume_dirs(
    pod: Mapping[str, Any],
    run_dir: Path,
    secrets: Mapping[str, Mapping[str, bytes]],
) -> tuple[dict[str, Path], dict[str, bytes]]:
    """Volume name → local directory, and the files that must exist in them."""
    pod_name = pod["metadata"]["name"]
    dirs: dict[str, Path] = {}
    files: dict[str, bytes] = {}
    for v in pod["spec"].get("volumes") or []:
        name = v["name"]
        if "secret" in v:
            local = run_dir / "pods" / pod_name / "secrets" / name
            data = secrets.get(v["secret"]["secretName"])
            if data is None:
                raise jobspec.InvalidSpec(
                    f"pod {pod_name}: volume {name} mounts secret {v['secret']['secretName']}, "
                    "which the job does not create"
                )
            for key, content in _items(v["secret"], data).items():
                files[str(local / key)] = content
        elif "configMap" in v:
            local = run_dir / "pods" / pod_name / "configmaps" / name
            cm = v["configMap"]["name"]
            for key, content in _items(v["configMap"], secrets.get(f"configmap/{cm}", {})).items():
                files[str(local / key)] = content
        elif name == CHECKPOINT_VOLUME:
            # Shared and kept whatever its source: the chief writes, a rerun with the same
            # --run-dir resumes, the summary points at it.
            local = run_dir / CHECKPOINT_VOLUME
        elif "hostPath" in v:
            # This machine is the node: the host path itself (the user's data, say).
            local = Path(v["hostPath"]["path"])
        elif "emptyDir" in v:
            local = run_dir / "pods" / pod_name / "volumes" / name
        else:
            # A PVC, hostPath, NFS...: storage the gang shares and that outlives a replica.
            local = run_dir / "volumes" / name
        dirs[name] = local
    return dirs, files


def _under_any(path: Path, roots: Iterable[Path]) -> bool:
    """A hostPath is the user's: never created (nor anything under it)."""
    return any(path == r or r in path.parents for r in roots)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _rewrite(
    value: str,
    mounts: Mapping[str, Path],
    run_dir: Path | None = None,
    user_mounts: Collection[str] = (),
) -> str:
    """An in-pod path under a mount → the local path (the longest mount path wins); any other
    value as it is. Never rewritten (docs/decisions/0200-local-run-paths.md): a path below the
    scratch mount ``/tmp`` (this machine's own ``/tmp``: only ``/tmp`` itself is the pod's), a
    path in the interpreter's environment or this checkout, and, below a mount of a volume the
    user declared in a pod template (``user_mounts``), a path that exists on this machine
    outside ``run_dir`` (the user's own file where the volume would hold it)."""
    for mount in sorted(mounts, key=len, reverse=True):
        if not _inside(value, mount):
            continue
        if value != mount and (
            mount.rstrip("/") == SCRATCH_MOUNT
            or any(_inside(value, keep) for keep in NEVER_REWRITTEN)
            or (
                mount in user_mounts
                and os.path.lexists(value)
                and not (run_dir is not None and _inside(value, str(run_dir)))
            )
        ):
            return value
        return str(mounts[mount]) + value[len(mount.rstrip("/")) :]
    return value


@dataclasses.dataclass
class _PodPaths:
    """One container's mounts: in-pod values made local (:func:`_rewrite`), each rewrite
    remembered with why (:attr:`Replica.rewritten`)."""

    mounts: Mapping[str, Path]  # mount path → local directory
    volumes: Mapping[str, str]  # mount path → volume name
    user_mounts: Collection[str]
    run_dir: Path
    rewritten: dict[str, str] = dataclasses.field(default_factory=dict)

    def local(self, value: str) -> str:
        new = _rewrite(value, self.mounts, self.run_dir, self.user_mounts)
        if new != value:
            mount = max((m for m in self.mounts if _inside(value, m)), key=len)
            self.rewritten[new] = (
                f"{value} in the pod (volume {self.volumes[mount]}, mounted at {mount})"
            )
        return new


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
    obj: Mapping[str, Any], run_dir: Path, *, port: Callable[[], int] | None = None
) -> tuple[jobspec.Job, list[Replica]]:
    """Load a TrainingJob and translate each of its Pods into a :class:`Replica`.

    ``port`` (default: :func:`port_allocator`) hands out the ring and metrics ports.
    Raises :class:`jobspec.InvalidSpec` with the offending field for anything that cannot run.
    """
    port = port or port_allocator()
    job = jobspec.load(obj)
    objs = (
        mpi.desired_objects(job, local=True)
        if job.mpi
        else manifests.desired_objects(job, endpoint=loopback_endpoints(port))
    )
    secrets = _secret_data(objs)
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
        volume_dirs, files = _volume_dirs(pod, run_dir, secrets)
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
        paths = _PodPaths(mounts, volume_of, user_mounts, run_dir)
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
                            if not _under_any(d, host_paths)
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
    if _inside(local, str(run_dir)) or os.path.isfile(local):
        return
    where = (
        f"{local}, where {model} in the pod is on this machine"
        if local != model
        else f"{model} on this machine (ringtrain run reads a path outside the pod's volumes "
        "as this machine's own)"
    )
    raise jobspec.InvalidSpec(f"spec.trainer.model: no such file: looked up {where}")


def read_job(path: str) -> dict:
    """The single TrainingJob in a YAML file (other kinds in a multi-document file are ignored)."""
    try:
        with open(path) as f:
            docs = [d for d in yamlsafe.load_all(f, path) if d]
    except OSError as e:
        raise jobspec.InvalidSpec(f"{path}: {e.strerror}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == jobspec.KIND]
    if len(jobs) != 1:
        raise jobspec.InvalidSpec(
            f"{path}: expected exactly one {jobspec.KIND} document, found {len(jobs)}"
        )
    return jobs[0]
