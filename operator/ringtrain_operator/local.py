"""`ringtrain run JOB.yaml`: a TrainingJob as local processes, one per replica, no cluster.

The same code path as Kubernetes: the manifest goes through :func:`spec.load` (the CRD's defaults
and validation) and :func:`manifests.desired_objects` (the operator's Pods, TF_CONFIG included),
with loopback endpoints on free ports. Each Pod's main container then runs here as a process:

* its command and args, with ``ringtrain`` meaning this interpreter's ``ringtrain.cli`` (so the
  worker runs the code of this checkout, whatever ``PATH`` holds);
* its env, ``valueFrom`` resolved from the rendered Secret and the Pod's own metadata;
* its volumes made local: the Secret volume becomes files in a private directory, emptyDirs
  per-replica directories, any other volume (the checkpoint volume) one directory the replicas
  share, like a PVC. Every arg and env value under a mount path is rewritten to the local one;
* ``--metrics-port`` replaced by a free port, ``--termination-log`` by a file in the run dir.

What the operator does with pods, the runner does with processes, and it decides with the
operator's own fold (:func:`status.derive_status`): the processes are presented as observed
Pods, and the runner starts and stops them as the returned decision creates and deletes Pods.
So restartPolicy, gang restarts (the whole gang is stopped and started again and resumes from
the shared checkpoint directory), backoffLimit, activeDeadlineSeconds and successPolicy mean
here exactly what they mean on a cluster. One difference: there is no kubelet, so no container
restarts in place; under OnFailure/Always a failed process is what the operator sees when the
kubelet gave up on a Pod, and restarts the gang. Outcome → exit code: 0 Succeeded, 1 Failed,
2 invalid job, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from ringtrain.errors import EXIT_TERMINATED, RingtrainError

from . import manifests, status
from . import spec as jobspec

#: Exit codes of `ringtrain run` (the job's outcome, not a replica's).
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C

#: How long replicas get between SIGTERM and SIGKILL (Kubernetes' default grace period is 30 s;
#: locally nobody wants to wait that long for a process that ignores SIGTERM).
DEFAULT_GRACE_S = 10.0
#: The Pod volume manifests.pod() mounts at spec.trainer.checkpoint.path.
CHECKPOINT_VOLUME = "checkpoints"


# ---- planning: Pods → processes (pure apart from the port allocator) ----------------------------

@dataclasses.dataclass(frozen=True)
class Replica:
    """One process to start: what a kubelet would run for one Pod, translated to this machine."""

    name: str          # the Pod name, e.g. "mnist-worker-0"
    role: str          # TF_CONFIG role
    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str]    # the Pod's env only; the process also inherits os.environ
    files: Mapping[str, bytes]  # local path → content, written 0600 before the start
    dirs: tuple[str, ...]       # local directories to create before the start
    metrics_port: int | None
    termination_log: str | None

    @property
    def label(self) -> str:
        return f"{self.role}-{self.index}"


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's choice, so parallel runs differ)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_endpoints(port: Callable[[], int] = free_port) -> manifests.Endpoint:
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
    out: dict[str, dict[str, bytes]] = {}
    for o in objs:
        if o.get("kind") == "Secret":
            data = {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            data.update({k: v.encode() for k, v in (o.get("stringData") or {}).items()})
            out[o["metadata"]["name"]] = data
    return out


def _field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta = pod["metadata"]
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", ""),
              "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
              "spec.nodeName": socket.gethostname(), "spec.serviceAccountName": "default"}
    if path in simple:
        return simple[path]
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return (meta.get(kind) or {}).get(path[len(prefix):-2], "")
    raise jobspec.InvalidSpec(f"pod {meta['name']}: env fieldRef {path!r} cannot be run locally")


def _env(pod: Mapping[str, Any], container: Mapping[str, Any],
         secrets: Mapping[str, Mapping[str, bytes]]) -> dict[str, str]:
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
                    f"{ref.get('name')}/{ref.get('key')}, which the job does not create") from None
        elif "fieldRef" in src:
            env[name] = _field_ref(pod, src["fieldRef"]["fieldPath"])
        else:
            raise jobspec.InvalidSpec(
                f"pod {pod['metadata']['name']}: env {name}: only value, secretKeyRef and "
                "fieldRef can be run locally")
    return env


def _volume_dirs(pod: Mapping[str, Any], run_dir: Path,
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
                    "which the job does not create")
            for key, content in data.items():
                files[str(local / key)] = content
        elif name == CHECKPOINT_VOLUME:
            # Shared and kept whatever its source: the chief writes, a rerun with the same
            # --run-dir resumes, the summary points at it.
            local = run_dir / CHECKPOINT_VOLUME
        elif "emptyDir" in v:
            local = run_dir / "pods" / pod_name / "volumes" / name
        else:
            # A PVC, hostPath, NFS...: storage the gang shares and that outlives a replica.
            local = run_dir / "volumes" / name
        dirs[name] = local
    return dirs, files


def _rewrite(value: str, mounts: Mapping[str, Path]) -> str:
    """An in-pod path under a mount → the local path (the longest mount path wins)."""
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + value[len(mount.rstrip("/")):]
    return value


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
    return command


def plan(obj: Mapping[str, Any], run_dir: Path, *,
         port: Callable[[], int] = free_port) -> tuple[jobspec.Job, list[Replica]]:
    """Load a TrainingJob and translate each of its Pods into a :class:`Replica`.

    Raises :class:`jobspec.InvalidSpec` with the offending field for anything that cannot run.
    """
    job = jobspec.load(obj)
    objs = manifests.desired_objects(job, endpoint=loopback_endpoints(port))
    secrets = _secret_data(objs)
    replicas = []
    for pod in (o for o in objs if o["kind"] == "Pod"):
        labels = pod["metadata"]["labels"]
        role, index = labels[manifests.LABEL_ROLE], int(labels[manifests.LABEL_INDEX])
        containers = pod["spec"].get("containers") or []
        main = next((c for c in containers if c.get("name") == manifests.MAIN_CONTAINER),
                    containers[0])
        others = [c["name"] for c in containers if c is not main]
        if others:
            raise jobspec.InvalidSpec(
                f"pod {pod['metadata']['name']}: sidecar containers {others} cannot be run locally")
        command = list(main.get("command") or [])
        args = list(main.get("args") or [])
        if not command:
            if not str(main.get("image", "")).split("/")[-1].startswith("ringtrain"):
                raise jobspec.InvalidSpec(
                    f"pod {pod['metadata']['name']}: container {main['name']} has no command; "
                    "locally there is no image ENTRYPOINT to fall back on")
            command = ["ringtrain"]  # the ringtrain image's ENTRYPOINT
        volume_dirs, files = _volume_dirs(pod, run_dir, secrets)
        mounts: dict[str, Path] = {}
        for m in main.get("volumeMounts") or []:
            local = volume_dirs[m["name"]]
            mounts[m["mountPath"]] = local / m["subPath"] if m.get("subPath") else local
        env = {k: _rewrite(v, mounts) for k, v in _env(pod, main, secrets).items()}
        args = [_rewrite(a, mounts) for a in args]
        metrics_port = None
        if any(p.get("name") == "metrics" for p in main.get("ports") or []):
            metrics_port = port()
            _set_flag(args, "--metrics-port", str(metrics_port))
        termination_log = None
        if _set_flag(args, "--termination-log",
                     str(run_dir / "pods" / pod["metadata"]["name"] / "termination-log")):
            termination_log = str(run_dir / "pods" / pod["metadata"]["name"] / "termination-log")
        replicas.append(Replica(
            name=pod["metadata"]["name"], role=role, index=index,
            argv=tuple(_local_command(command) + args), env=env, files=files,
            dirs=tuple(sorted({str(d) for d in [*volume_dirs.values(), *mounts.values(),
                                                run_dir / "pods" / pod["metadata"]["name"]]})),
            metrics_port=metrics_port, termination_log=termination_log,
        ))
    return job, replicas


def read_job(path: str) -> dict:
    """The single TrainingJob in a YAML file (other kinds in a multi-document file are ignored)."""
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
    except OSError as e:
        raise jobspec.InvalidSpec(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise jobspec.InvalidSpec(f"{path}: not valid YAML: {e}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == jobspec.KIND]
    if len(jobs) != 1:
        raise jobspec.InvalidSpec(
            f"{path}: expected exactly one {jobspec.KIND} document, found {len(jobs)}")
    return jobs[0]


# ---- the job's state, folded from replica output (pure) -----------------------------------------

@dataclasses.dataclass
class WorkerState:
    step: int | None = None
    last_output_s: float | None = None
    exit_code: int | None = None

    def health(self, now_s: float, stale_after_s: float) -> str:
        if self.exit_code is not None:
            return "done" if self.exit_code == 0 else f"exit {self.exit_code}"
        if self.last_output_s is not None and now_s - self.last_output_s > stale_after_s:
            return f"silent {now_s - self.last_output_s:.0f}s"
        return "ok"


@dataclasses.dataclass
class JobState:
    """Progress of the job as the chief reports it, plus each replica's health."""

    total_steps: int | None
    started_s: float
    workers: dict[str, WorkerState]
    step: int | None = None
    epoch: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    test_accuracy: float | None = None
    final: dict | None = None

    def observe(self, label: str, event: Mapping[str, Any], now_s: float, chief: bool) -> None:
        w = self.workers[label]
        w.last_output_s = now_s
        if isinstance(event.get("step"), int):
            w.step = event["step"]
        if not chief:
            return
        kind = event.get("event")
        if kind == "progress":
            for f in ("step", "epoch", "loss", "samples_per_s", "eta_s", "total_steps"):
                if event.get(f) is not None:
                    setattr(self, f, event[f])
        elif kind == "eval" and event.get("test_accuracy") is not None:
            self.test_accuracy = event["test_accuracy"]
        elif kind == "final":
            self.final = dict(event)
            if event.get("test_accuracy") is not None:
                self.test_accuracy = event["test_accuracy"]
            if event.get("steps") is not None:
                self.step = event["steps"]

    def new_gang(self, labels: Iterable[str], now_s: float) -> None:
        """A restarted gang resumes from a checkpoint: forget the old gang's step and health."""
        for label in labels:
            self.workers[label] = WorkerState(last_output_s=now_s)
        self.step = self.epoch = self.loss = self.samples_per_s = self.eta_s = None
        self.final = None

    def progress(self, now_s: float, stale_after_s: float = 60.0) -> dict:
        return {
            "event": "progress", "step": self.step, "total_steps": self.total_steps,
            "epoch": self.epoch, "loss": self.loss, "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s, "test_accuracy": self.test_accuracy,
            "elapsed_s": round(now_s - self.started_s, 3),
            "workers": {k: w.health(now_s, stale_after_s) for k, w in self.workers.items()},
        }


def format_progress(p: Mapping[str, Any]) -> str:
    """One human line: ``step 120/500 (24%)  loss 0.4123  8,412 samples/s  ETA 0:45  [health]``."""
    parts = []
    step, total = p.get("step"), p.get("total_steps")
    if step is None:
        parts.append("starting")
    elif total:
        parts.append(f"step {step}/{total} ({100 * step // total}%)")
    else:
        parts.append(f"step {step}")
    if p.get("epoch") is not None:
        parts.append(f"epoch {p['epoch']:.2f}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p.get("samples_per_s") is not None:
        parts.append(f"{p['samples_per_s']:,.0f} samples/s")
    if p.get("test_accuracy") is not None:
        parts.append(f"acc {100 * p['test_accuracy']:.2f}%")
    if p.get("eta_s") is not None:
        parts.append(f"ETA {_duration(p['eta_s'])}")
    if p.get("restarts"):
        parts.append(f"restarts {p['restarts']}")
    health = " ".join(f"{k} {v}" for k, v in (p.get("workers") or {}).items())
    return "  ".join(parts) + (f"  [{health}]" if health else "")


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def observed_pod(replica: Replica, proc: subprocess.Popen) -> status.ObservedPod:
    """A replica's process as the Pod the operator's fold would observe.

    There is no kubelet here, so a process is a Pod whose container never restarts in place: it
    is Running until it exits, then Succeeded (exit 0) or Failed with the exit code Kubernetes
    would report (a signal n becomes 128 + n, named like the kubelet's reason).
    """
    code = proc.poll()
    if code is None:
        return status.ObservedPod(name=replica.name, role=replica.role, index=replica.index,
                                  phase="Running", ready=True)
    return status.ObservedPod(
        name=replica.name, role=replica.role, index=replica.index,
        phase="Succeeded" if code == 0 else "Failed", exit_code=exit_status(code),
        exit_reason=signal.Signals(-code).name if code < 0 else None)


def terminal_condition(job_status: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(reason, message) of the condition that ended the job, as ``kubectl describe`` shows it."""
    state = job_status.get("state")
    for c in job_status.get("conditions") or []:
        if c["type"] == state and c["status"] == "True":
            return c.get("reason"), c.get("message")
    return None, None


# ---- running -------------------------------------------------------------------------------------

class Output:
    """Where the runner writes: replica logs, the live progress line, events, the summary.

    Human mode redraws one progress line at the bottom of a terminal (or prints it every few
    seconds when stdout is not one); ``--json`` writes one object per line on stdout and the
    replicas' logs, prefixed, on stderr.
    """

    def __init__(self, json_mode: bool, out: TextIO, err: TextIO, interval_s: float = 5.0):
        self.json_mode, self.out, self.err = json_mode, out, err
        self.live = not json_mode and out.isatty()
        self.interval_s = interval_s if not self.live else 0.2
        self._last_progress_s = float("-inf")
        self._line = ""
        self._lock = threading.Lock()

    def _clear(self) -> None:
        if self.live and self._line:
            self.out.write("\r\x1b[2K")

    def log(self, label: str, line: str) -> None:
        with self._lock:
            self._clear()
            stream = self.err if self.json_mode else self.out
            stream.write(f"{label:<10}| {line}\n")
            stream.flush()
            if self.live and self._line:
                self.out.write(self._line)
                self.out.flush()

    def event(self, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if self.json_mode:
                self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")
                self.out.flush()

    def progress(self, p: Mapping[str, Any], now_s: float, force: bool = False) -> None:
        if not force and now_s - self._last_progress_s < self.interval_s:
            return
        self._last_progress_s = now_s
        if self.json_mode:
            self.event(p)
            return
        with self._lock:
            line = format_progress(p)
            if self.live:
                self._line = line[: shutil.get_terminal_size((120, 20)).columns - 1]
                self.out.write("\r\x1b[2K" + self._line)
            else:
                self.out.write(f"progress  | {line}\n")
            self.out.flush()

    def message(self, text: str) -> None:
        if not self.json_mode:
            with self._lock:
                self._clear()
                self.out.write(text + "\n")
                self._line = ""
                self.out.flush()


class Stopped(Exception):
    """The runner received SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Runner:
    """Carries out the operator's decisions with processes instead of Pods.

    Each turn observes the current processes as Pods (:func:`observed_pod`), folds them with the
    job's previous status through :func:`status.derive_status` — the operator's own lifecycle:
    restart policies, gang restarts, backoffLimit, activeDeadlineSeconds, successPolicy — and
    does what the decision says: start the replicas it creates, stop the ones it deletes. So a
    job behaves here as it would on a cluster, with one implementation of the rules.
    """

    def __init__(self, job: jobspec.Job, replicas: list[Replica], run_dir: Path, output: Output,
                 grace_s: float = DEFAULT_GRACE_S,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self.job, self.replicas, self.run_dir, self.output = job, replicas, run_dir, output
        self.grace_s, self.clock = grace_s, clock
        self.by_name = {r.name: r for r in replicas}
        #: The current process of each replica (label → process); a gang restart replaces them.
        self.procs: dict[str, subprocess.Popen] = {}
        self.pumps: dict[str, threading.Thread] = {}
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.state = JobState(
            total_steps=job.trainer.steps if job.trainer else None, started_s=time.monotonic(),
            workers={r.label: WorkerState() for r in replicas})
        self.chief_label = f"{job.chief[0]}-{job.chief[1]}"
        #: The TrainingJob's status as the operator would write it (state, conditions, restarts).
        self.status: dict[str, Any] = {}
        self.started = False

    @property
    def phase(self) -> str | None:
        return self.status.get("state")

    @property
    def restarts(self) -> int:
        return int(self.status.get("restarts", 0))

    def _materialize(self, r: Replica) -> None:
        for d in r.dirs:
            Path(d).mkdir(parents=True, exist_ok=True)
        for path, content in r.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(content)

    def _pump(self, label: str, stream: TextIO) -> None:
        for line in stream:
            self.lines.put((label, line.rstrip("\n")))
        self.lines.put((label, None))

    def _create(self, names: Iterable[str]) -> None:
        """Start the named replicas: what the kubelet does with a newly created Pod."""
        todo = [self.by_name[n] for n in names]
        for r in todo:
            self._materialize(r)
        if self.started and todo:  # a new gang after a restart: old progress no longer applies
            self.state.new_gang([r.label for r in todo], time.monotonic())
            resume = (f", resuming from the latest checkpoint in {self.run_dir / CHECKPOINT_VOLUME}"
                      if self.job.trainer else "")
            self.output.message(f"restart {self.restarts}: starting {len(todo)} replicas{resume}")
        for r in todo:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **r.env}
            # Own session: a terminal's Ctrl-C reaches only the runner, which then stops every
            # replica the same way (SIGTERM, grace, SIGKILL) — as the kubelet does.
            p = subprocess.Popen(r.argv, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                 bufsize=1, start_new_session=True, cwd=self.run_dir)
            self.procs[r.label] = p
            t = threading.Thread(target=self._pump, args=(r.label, p.stdout), daemon=True,
                                 name=f"pump-{r.label}")
            t.start()
            self.pumps[r.label] = t
            self.output.event({"event": "started", "replica": r.label, "pod": r.name,
                               "pid": p.pid, "restarts": self.restarts})
        self.started = self.started or bool(todo)

    def _delete(self, names: Iterable[str]) -> None:
        """Stop the named replicas (SIGTERM, grace, SIGKILL), keeping their exit codes.

        Their output is read to the end before this returns, so a replica that is started again
        next never has its predecessor's last lines attributed to it.
        """
        labels = [self.by_name[n].label for n in names if self.by_name[n].label in self.procs]
        live = [self.procs[label] for label in labels if self.procs[label].poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for label in labels:
            # EOF follows the exit unless a grandchild holds the pipe open.
            self.pumps[label].join(timeout=self.grace_s)
            self.state.workers[label].exit_code = exit_status(self.procs[label].returncode)
        self._drain()

    def stop(self) -> None:
        """Stop every replica that still runs: the end of the job, or Ctrl-C."""
        self._delete([r.name for r in self.replicas if r.label in self.procs])

    def _handle(self, label: str, line: str) -> None:
        now = time.monotonic()
        event = None
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
        if isinstance(event, dict) and "event" in event:
            self.state.observe(label, event, now, chief=label == self.chief_label)
            if label == self.chief_label and event["event"] in ("eval", "final"):
                self.output.log(label, _describe(event))
        else:
            self.state.workers[label].last_output_s = now
            self.output.log(label, line)

    def _drain(self) -> None:
        """Consume what is queued, so the last lines are shown before anything that follows."""
        while True:
            try:
                label, line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self._handle(label, line)

    def _poll_status(self, stop: threading.Event, period_s: float = 2.0) -> None:
        """Health of replicas that print nothing (non-chief workers): their ``/status``."""
        ports = {r.label: r.metrics_port for r in self.replicas if r.metrics_port}
        while not stop.wait(period_s):
            for label, port in ports.items():
                p = self.procs.get(label)
                if p is not None and p.poll() is None and (st := fetch_status(port)) is not None:
                    w = self.state.workers[label]
                    w.last_output_s = time.monotonic()
                    if isinstance(st.get("step"), int):
                        w.step = st["step"]

    def reconcile(self) -> status.Decision:
        """One turn of the operator's loop: observe, fold, act. Returns the decision taken."""
        pods = [observed_pod(self.by_name[n], p)
                for n, p in ((r.name, self.procs.get(r.label)) for r in self.replicas)
                if p is not None]
        decision = status.derive_status(self.job, pods, self.clock(), self.status)
        self.status = decision.status
        for e in decision.events:
            self.output.event({"event": "status", "type": e.type, "reason": e.reason,
                               "message": e.message, "phase": self.phase,
                               "restarts": self.restarts})
            if e.type == "Warning":
                self.output.message(f"{e.reason}: {e.message}")
        if self.phase in status.TERMINAL:
            return decision  # what is still running is stopped by the caller (stop())
        self._delete(decision.delete)
        for name in decision.delete:
            del self.procs[self.by_name[name].label]
        self._create(decision.create)
        return decision

    def progress(self, now_s: float) -> dict:
        return {**self.state.progress(now_s), "phase": self.phase, "restarts": self.restarts}

    def wait(self) -> str:
        """Run until the job is Succeeded or Failed; returns that phase.

        After a success the other ring members get the grace period to finish on their own
        (they run the same number of steps) rather than being stopped at once, so their exit
        codes say how they really ended.
        """
        stop_polling = threading.Event()
        threading.Thread(target=self._poll_status, args=(stop_polling,), daemon=True,
                         name="status-poller").start()
        try:
            while True:
                self.reconcile()
                if self.phase in status.TERMINAL:
                    break
                try:
                    label, line = self.lines.get(timeout=0.2)
                    if line is not None:
                        self._handle(label, line)
                    self._drain()
                except queue.Empty:
                    pass
                now = time.monotonic()
                self.output.progress(self.progress(now), now)
            if self.phase == status.SUCCEEDED:
                self._let_ring_finish()
            return self.phase
        finally:
            stop_polling.set()

    def _let_ring_finish(self) -> None:
        ring = [self.procs[r.label] for r in self.replicas
                if r.role in ("chief", "worker") and r.label in self.procs]
        end = time.monotonic() + self.grace_s
        for p in ring:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return


def exit_status(returncode: int) -> int:
    """A container's exit code as Kubernetes reports it: a signal n becomes 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _describe(event: Mapping[str, Any]) -> str:
    fields = ", ".join(f"{k}={v}" for k, v in event.items() if k != "event")
    return f"{event['event']}: {fields}"


def _read_result(r: Replica) -> dict | None:
    if not r.termination_log:
        return None
    try:
        return json.loads(Path(r.termination_log).read_text())
    except (OSError, ValueError):
        return None


def fetch_status(port: int, timeout_s: float = 1.0) -> dict | None:
    """A replica's JSON ``/status`` (docs/contracts.md), or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def summary(job: jobspec.Job, phase: str, state: JobState, replicas: list[Replica],
            exits: Mapping[str, int | None], run_dir: Path, elapsed_s: float,
            reason: str | None, message: str | None = None, restarts: int = 0) -> dict:
    """The final object: the job's phase (with the condition's reason and message, as the
    operator writes them), its gang restarts, and the chief's final metrics."""
    chief = next(r for r in replicas if (r.role, r.index) == job.chief)
    final = state.final or _read_result(chief) or {}
    checkpoint = final.get("checkpoint")
    if checkpoint is None and job.trainer:
        checkpoint = str(run_dir / CHECKPOINT_VOLUME)
    return {
        "event": "final", "job": job.name, "phase": phase, "reason": reason,
        "message": message, "restarts": restarts,
        "steps": final.get("steps", state.step), "loss": final.get("loss", state.loss),
        "test_accuracy": final.get("test_accuracy", state.test_accuracy),
        "samples_per_s": final.get("samples_per_s", state.samples_per_s),
        "elapsed_s": round(elapsed_s, 3), "checkpoint": checkpoint,
        "run_dir": str(run_dir), "exit_codes": dict(exits),
    }


def format_summary(s: Mapping[str, Any]) -> str:
    failed = s["phase"] != status.SUCCEEDED
    reason = f" ({s['reason']})" if failed and s.get("reason") else ""
    lines = [f"TrainingJob {s['job']}: {s['phase']}{reason}"]
    if failed and s.get("message"):
        lines.append(f"  why            {s['message']}")
    if s.get("restarts"):
        lines.append(f"  restarts       {s['restarts']}")
    if s.get("steps") is not None:
        lines.append(f"  steps          {s['steps']}")
    if s.get("loss") is not None:
        lines.append(f"  final loss     {s['loss']:.4f}")
    if s.get("test_accuracy") is not None:
        lines.append(f"  test accuracy  {100 * s['test_accuracy']:.2f}%")
    if s.get("samples_per_s") is not None:
        lines.append(f"  samples/s      {s['samples_per_s']:,.0f}")
    lines.append(f"  time           {_duration(s['elapsed_s'])}")
    if s.get("checkpoint"):
        lines.append(f"  checkpoint     {s['checkpoint']}")
    lines.append(f"  logs and data  {s['run_dir']}")
    codes = " ".join(f"{k}={v}" for k, v in s["exit_codes"].items())
    lines.append(f"  exit codes     {codes}")
    return "\n".join(lines)


def default_run_dir(job_name: str) -> Path:
    """A fresh directory per run: a new run never resumes an old run's checkpoint by surprise."""
    return Path(".ringtrain") / "runs" / f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain run",
        description="Run a TrainingJob manifest on this machine: one process per replica, "
                    "loopback TF_CONFIG, the operator's own Pod definitions.")
    p.add_argument("manifest", help="YAML file holding one TrainingJob")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line on stdout (progress, then the final result); "
                        "replica logs go to stderr")
    p.add_argument("--run-dir", type=Path,
                   help="where checkpoints, tokens and results go (default: a fresh "
                        ".ringtrain/runs/<job>-<time>; reuse one to resume from its checkpoint)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping replicas "
                        "(default %(default)s)")
    p.add_argument("--progress-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between progress lines when stdout is not a terminal")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    output = Output(args.json, sys.stdout, sys.stderr, args.progress_interval)
    try:
        obj = read_job(args.manifest)
        name = (obj.get("metadata") or {}).get("name") or "job"
        run_dir = (args.run_dir or default_run_dir(str(name))).resolve()
        job, replicas = plan(obj, run_dir)
    except RingtrainError as e:
        if args.json:
            output.event({"event": "final", "phase": "Failed", "reason": "InvalidSpec",
                          "message": str(e)})
        print(f"ringtrain run: invalid TrainingJob: {e}", file=sys.stderr)
        return EXIT_INVALID

    run_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(job, replicas, run_dir, output, grace_s=args.grace_period)
    output.event({"event": "start", "job": job.name, "run_dir": str(run_dir),
                  "replicas": {r.label: {"pod": r.name, "metrics_port": r.metrics_port}
                               for r in replicas}})
    output.message(f"TrainingJob {job.name}: {len(replicas)} replicas, run dir {run_dir}")
    for r in replicas:
        if r.metrics_port:
            output.message(f"  {r.label:<10} metrics http://127.0.0.1:{r.metrics_port}/metrics")

    def on_signal(signum: int, _frame: Any) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    reason = message = None
    try:
        phase = runner.wait()
    except Stopped as e:
        phase, reason, message = status.FAILED, "Stopped", f"stopped by {e}"
        output.message(f"\n{e}: stopping {len(runner.procs)} replicas")
    finally:
        # A second Ctrl-C during the grace period must not leave orphans behind.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        runner.stop()
        for s, h in previous.items():
            signal.signal(s, h)

    elapsed = time.monotonic() - runner.state.started_s
    if reason is None:
        reason, message = terminal_condition(runner.status)
    exits = {label: None if p.returncode is None else exit_status(p.returncode)
             for label, p in runner.procs.items()}
    result = summary(job, phase, runner.state, replicas, exits, run_dir, elapsed, reason,
                     message, runner.restarts)
    output.progress(runner.progress(time.monotonic()), time.monotonic(), force=True)
    output.event(result)
    output.message("\n" + format_summary(result))
    if reason == "Stopped":
        return EXIT_INTERRUPTED if "SIGINT" in message else EXIT_TERMINATED
    return EXIT_SUCCEEDED if phase == status.SUCCEEDED else EXIT_FAILED
