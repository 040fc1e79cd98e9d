"""The local backend: a job is a ``ringtrain run`` process and its run dir.

Pipeline position: the client's submit writes the manifest and the input files into a fresh run
dir and starts ``ringtrain run <dir>/job.yaml --json --run-dir <dir>`` as a child process in a
session of its own (it outlives a notebook cell; its events go to ``events.jsonl``), so the
planner, the supervisor and the operator's lifecycle fold are exactly what ``ringtrain run``
uses — nothing re-implemented here. Everything after that reads the run dir, which ``ringtrain
run`` keeps whoever started it: ``run.json`` (its pid, the chief) while it runs, ``final.json``
when it ended, each replica's log, the chief's JSON events in its log. So ``ringtrain
status|wait|delete`` work on a run started by hand too.

A job's name is its run dir's: ``<root>/<job>-<time>`` (root ``.ringtrain/runs`` as
``ringtrain run``'s default; ``ringtrain logs <job>`` finds it); a name given with its time
suffix, or a run dir's path, names that run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import yaml

from ringtrain_localrun import logs
from ringtrain_localrun.cli import default_run_dir

from .jobs import FAILED, JobNotFound, JobStatus, Metrics, fold_metrics
from .progress import from_status

#: ``ringtrain run``'s events (its ``--json`` stdout), written by the client's submit
EVENTS_NAME = "events.jsonl"
#: the manifest the client submitted
MANIFEST_NAME = "job.yaml"
#: the pid of the ``ringtrain run`` the backend started
PID_NAME = "submitted.pid"
#: where the client puts the model and the data the replicas read
INPUTS_DIR = "inputs"
#: ``ringtrain run``'s own stderr (a refusal before anything started is there)
STDERR_NAME = "run.err"
#: seconds between ``ringtrain run``'s progress events in ``events.jsonl`` (its own default is
#: 5 s off a terminal; ``wait()``'s progress line follows the chief's, at most one a second)
PROGRESS_INTERVAL_S = 1.0
#: seconds ``delete`` waits for ``ringtrain run`` to stop its replicas before SIGKILL
STOP_TIMEOUT_S = 30.0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a child this process started and did not reap
    yet counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class LocalBackend:
    """Jobs as ``ringtrain run`` processes under ``root`` (default ``.ringtrain/runs``)."""

    name = "local"

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root) if root is not None else Path(".ringtrain") / "runs"
        #: the ``ringtrain run`` processes this backend started (reaped when they end)
        self._children: dict[Path, subprocess.Popen[bytes]] = {}

    # --- where a job is -----------------------------------------------------------------------

    def new_run_dir(self, name: str) -> Path:
        return (self.root / default_run_dir(name).name).resolve()

    def run_dir(self, name: str) -> Path:
        """The run dir of ``name``: a path, a run dir's name, or a job name (its newest run)."""
        for candidate in (Path(name), self.root / name):
            if (candidate / MANIFEST_NAME).is_file() or (candidate / logs.RUN_NAME).is_file():
                return candidate.resolve()
        runs = sorted(self.root.glob(f"{name}-*"))  # a job name: its newest run
        found = next((r for r in reversed(runs) if r.name[len(name) + 1 :][:1].isdigit()), None)
        if found is None:
            raise JobNotFound(f"no local run of {name!r} under {self.root}")
        return found.resolve()

    def input_path(self, run_dir: Path, file: str) -> Path:
        return run_dir / INPUTS_DIR / file

    # --- the calls ---------------------------------------------------------------------------

    def submit(self, obj: dict[str, Any], run_dir: Path) -> str:
        """Start ``ringtrain run`` on ``obj`` in ``run_dir`` (already holding the inputs);
        returns the job's name (the run dir's)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        manifest = run_dir / MANIFEST_NAME
        manifest.write_text(yaml.safe_dump(obj, sort_keys=False))
        return self._run(manifest, run_dir)

    def start(self, manifest: str | os.PathLike[str], name: str) -> str:
        """``ringtrain submit``: run the user's own manifest where it is (its relative paths
        stay theirs) in a new run dir for ``name``; returns the run dir's name."""
        run_dir = self.new_run_dir(name)
        run_dir.mkdir(parents=True, exist_ok=True)
        source = Path(manifest).resolve()
        # the record: what ran; private, as its Secrets' files are (``ringtrain run``)
        fd = os.open(run_dir / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(source.read_bytes())
        return self._run(source, run_dir)

    def _run(self, manifest: Path, run_dir: Path) -> str:
        argv = [sys.executable, "-m", "ringtrain.cli", "run", str(manifest), "--json"]
        argv += ["--run-dir", str(run_dir), "--progress-interval", str(PROGRESS_INTERVAL_S)]
        with open(run_dir / EVENTS_NAME, "wb") as out, open(run_dir / STDERR_NAME, "wb") as err:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        self._children[run_dir] = proc
        # for another process's calls (``ringtrain submit`` then ``wait``) until run.json exists
        (run_dir / PID_NAME).write_text(str(proc.pid))
        return run_dir.name

    def _reap(self, run_dir: Path) -> None:
        """Collect a ``ringtrain run`` this backend started that wrote its result (it exits
        right after), so no zombie outlives the job."""
        child = self._children.pop(run_dir, None)
        if child is not None:
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._children[run_dir] = child

    def _pid(self, run_dir: Path) -> int | None:
        run = _read_json(run_dir / logs.RUN_NAME) or {}
        pid = run.get("pid")
        if isinstance(pid, int):
            return pid
        child = self._children.get(run_dir)
        if child is not None:
            return child.pid
        try:
            return int((run_dir / PID_NAME).read_text())
        except (OSError, ValueError):
            return None

    def _running(self, run_dir: Path) -> bool:
        child = self._children.get(run_dir)
        if child is not None:
            return child.poll() is None
        pid = self._pid(run_dir)
        return pid is not None and _alive(pid)

    def _events(self, run_dir: Path) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(OSError):
            for line in (run_dir / EVENTS_NAME).read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if isinstance(doc, dict):
                        out.append(doc)
        return out

    def status(self, name: str) -> JobStatus:
        run_dir = self.run_dir(name)
        where = str(run_dir)
        final = _read_json(run_dir / logs.FINAL_NAME)
        if final is not None:
            self._reap(run_dir)
            return JobStatus(
                name=run_dir.name,
                backend=self.name,
                phase=final.get("phase"),
                reason=final.get("reason"),
                message=final.get("message"),
                step=final.get("steps"),
                loss=final.get("loss"),
                test_accuracy=final.get("test_accuracy"),
                restarts=int(final.get("restarts") or 0),
                export=final.get("export"),
                location=where,
            )
        evts = self._events(run_dir)
        status: dict[str, Any] = next((e for e in reversed(evts) if e.get("event") == "status"), {})
        running = self._running(run_dir)
        if not running:
            self._reap(run_dir)
            # ended without final.json: refused before it started, or killed
            err = ""
            with contextlib.suppress(OSError):
                err = (run_dir / STDERR_NAME).read_text(errors="replace").strip()
            refused = next((e for e in evts if e.get("event") == "final"), None)
            if refused is not None:
                reason, message = refused.get("reason"), refused.get("message")
            else:
                reason, message = "Lost", err[-2000:] or "ringtrain run ended without a result"
            return JobStatus(run_dir.name, self.name, FAILED, reason, message, location=where)
        m = self.metrics(run_dir.name)
        last = m.progress[-1] if m.progress else None
        return JobStatus(
            name=run_dir.name,
            backend=self.name,
            phase=status.get("phase") or "Created",
            reason=status.get("reason"),
            message=status.get("message"),
            step=last.step if last else None,
            total_steps=last.total_steps if last else None,
            loss=last.loss if last else None,
            test_accuracy=m.evaluations[-1].test_accuracy if m.evaluations else None,
            restarts=int(status.get("restarts") or 0),
            location=where,
        )

    def progress(self, st: JobStatus) -> Mapping[str, Any]:
        """``ringtrain run``'s last progress event (the line it draws, the workers' health
        included), else what ``st`` knows."""
        if st.location is not None:
            evts = self._events(Path(st.location))
            last = next((e for e in reversed(evts) if e.get("event") == "progress"), None)
            if last is not None:
                return last
        return from_status(st)

    def _chief_log(self, run_dir: Path) -> Path | None:
        run = _read_json(run_dir / logs.RUN_NAME) or {}
        chief = run.get("chief")
        replicas = run.get("replicas") or {}
        log = (replicas.get(chief) or {}).get("log") if isinstance(replicas, dict) else None
        return Path(log) if isinstance(log, str) else None

    def metrics(self, name: str) -> Metrics:
        run_dir = self.run_dir(name)
        log = self._chief_log(run_dir)
        if log is None:
            return Metrics()
        lines: list[str] = []
        for p in (log.with_name(logs.ROTATED_NAME), log):
            with contextlib.suppress(OSError):
                lines += p.read_text(errors="replace").splitlines()
        return fold_metrics(lines)

    def logs(self, name: str, replica: str | None, follow: bool, out: TextIO) -> int:
        return logs.print_logs(self.run_dir(name), replica, follow, out)

    def export(self, name: str) -> Path:
        st = self.status(name)
        if not st.export:
            raise FileNotFoundError(
                f"{st.name}: no exported model ({st.phase}; the chief exports when it succeeds)"
            )
        return Path(st.export)

    def delete(self, name: str) -> None:
        """Stop the run if it goes on (SIGTERM: ``ringtrain run`` stops its replicas within
        their grace period), then remove its run dir."""
        run_dir = self.run_dir(name)
        pid = self._pid(run_dir)
        if pid is not None and self._running(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self._running(run_dir) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._running(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        child = self._children.pop(run_dir, None)
        if child is not None:
            child.wait()
        shutil.rmtree(run_dir, ignore_errors=True)

    def list(self) -> list[JobStatus]:
        dirs = sorted(p for p in self.root.glob("*") if p.is_dir()) if self.root.is_dir() else []
        out = []
        for d in dirs:
            if (d / MANIFEST_NAME).is_file() or (d / logs.RUN_NAME).is_file():
                with contextlib.suppress(JobNotFound):
                    out.append(self.status(str(d)))
        return out
