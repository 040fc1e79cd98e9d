"""A replica's log: written by `ringtrain run`, rotated by size, read by `ringtrain logs`.

Pipeline position: the supervisor's reader of each replica's output writes every line to
``<run dir>/pods/<pod>/log`` (:class:`ReplicaLog`) as it shows it, so the run dir the summary
names ("logs and data") holds what every replica printed, after the run too. `ringtrain logs
RUN_DIR [--replica worker-0] [--follow]` prints them (:func:`main`); a cluster job's logs are
not read yet (``kubectl logs``).

Rotation is the kubelet's shape, smaller: ``log`` grows to :data:`LOG_MAX_BYTES`, then becomes
``log.1`` (replacing the one before) and a new ``log`` starts, so a replica keeps between 10
and 20 MiB of its latest output whatever the run's length (the kubelet's default
containerLogMaxSize is 10 MiB). A replica restarted in place or recreated appends to its log
after a marker line (:data:`RESTART_MARK`, :data:`RECREATED_MARK`), where a cluster keeps the
previous container's log apart (``kubectl logs --previous``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, TextIO

#: Bytes of one log file before it is rotated (``log`` → ``log.1``); at most twice this per replica.
LOG_MAX_BYTES = 10 * 2**20
#: The file name of a replica's log in its pod directory, and of its rotated predecessor.
LOG_NAME, ROTATED_NAME = "log", "log.1"
#: The line `ringtrain run` writes into a replica's log before a restart in place's output.
RESTART_MARK = "----- ringtrain run: {label} started again in place (restart {n}) -----"
#: ... and before a recreated replica's (its pod replaced: the job's restart ``n``).
RECREATED_MARK = "----- ringtrain run: {label} recreated (job restart {n}) -----"
#: What `ringtrain run` writes in the run dir when it ends: `ringtrain logs --follow` stops then.
FINAL_NAME = "final.json"
#: What `ringtrain run` writes in the run dir when it starts: its pid, the replicas and the chief.
RUN_NAME = "run.json"
#: Seconds between looks for new output under --follow.
FOLLOW_POLL_S = 0.2


class ReplicaLog:
    """One replica's log file, appended line by line (flushed, so `ringtrain logs --follow`
    and a user's ``tail -f`` see each line at once) and rotated at ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._f: BinaryIO | None = None
        self._size = 0
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", errors="replace")
        with self._lock:
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "ab")  # noqa: SIM115 (kept open across writes)
                self._size = self._f.tell()
            if self._size and self._size + len(data) > self.max_bytes:
                self._f.close()
                os.replace(self.path, self.path.with_name(ROTATED_NAME))
                self._f = open(self.path, "ab")  # noqa: SIM115
                self._size = 0
            self._f.write(data)
            self._f.flush()
            self._size += len(data)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def label_of(pod: str) -> str:
    """A pod's replica name: ``mnist-worker-0`` → ``worker-0``; an MPI job's launcher pod
    (``hvd-launcher``, no index) → ``launcher-0``. Roles have no dash; a job name may."""
    head, _, last = pod.rpartition("-")
    return f"{head.rpartition('-')[2]}-{last}" if last.isdigit() else f"{last}-0"


def pod_dirs(run_dir: Path) -> list[Path]:
    """The pod directories of a run that hold a log, in name order."""
    pods = run_dir / "pods"
    return sorted(d for d in (pods.iterdir() if pods.is_dir() else ()) if (d / LOG_NAME).exists())


def resolve_run_dir(where: str, cwd: Path) -> Path | None:
    """A run dir, or a job's name: its newest ``.ringtrain/runs/<job>-<time>`` under ``cwd``
    (`ringtrain run`'s default run dir)."""
    path = Path(where)
    if (path / "pods").is_dir():
        return path
    runs = sorted((cwd / ".ringtrain" / "runs").glob(f"{where}-*"), key=lambda p: p.name)
    runs = [r for r in runs if r.name[len(where) + 1 :][:1].isdigit() and (r / "pods").is_dir()]
    return runs[-1] if runs else None


def _lines(data: bytes) -> list[str]:
    """Complete lines of ``data`` (a last line without its newline is kept too)."""
    text = data.decode("utf-8", errors="replace")
    return text.removesuffix("\n").split("\n") if text else []


class _Follower:
    """Reads what is appended to one log, across rotations (the old file is read to its end
    before the new one is opened)."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self._partial = b""

    def read(self) -> list[str]:
        out: list[str] = []
        if self._f is None:
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115
            except FileNotFoundError:
                return out
            self._ino = os.fstat(self._f.fileno()).st_ino
        out += self._drain()
        try:
            rotated = os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            rotated = False
        if rotated:
            out += self._drain()  # the rotated file is complete now
            self._f.close()
            self._f = None
            out += self.read()
        return out

    def _drain(self) -> list[str]:
        assert self._f is not None
        data = self._partial + self._f.read()
        complete, newline, self._partial = data.rpartition(b"\n")
        return _lines(complete + newline) if newline else []

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def print_logs(
    run_dir: Path, replica: str | None, follow: bool, out: TextIO, poll_s: float = FOLLOW_POLL_S
) -> int:
    """Print a run's logs (one replica's as written; several prefixed ``worker-0  | ``);
    under ``follow``, then what is appended until the run has ended. Returns the exit code."""
    dirs = pod_dirs(run_dir)
    if replica is not None:
        dirs = [d for d in dirs if replica in (d.name, label_of(d.name))]
        if not dirs:
            known = ", ".join(label_of(d.name) for d in pod_dirs(run_dir)) or "none yet"
            print(
                f"ringtrain logs: no replica {replica!r} in {run_dir} (replicas: {known})",
                file=sys.stderr,
            )
            return 2
    # several replicas: each line says whose (one that printed nothing has no log yet)
    prefix = replica is None and sum(1 for d in (run_dir / "pods").iterdir() if d.is_dir()) > 1

    def show(d: Path, lines: list[str]) -> None:
        for line in lines:
            out.write(f"{label_of(d.name):<10}| {line}\n" if prefix else line + "\n")
        out.flush()

    followers = {}
    for d in dirs:
        rotated = d / ROTATED_NAME
        if rotated.exists():
            show(d, _lines(rotated.read_bytes()))
        followers[d] = _Follower(d / LOG_NAME)
        show(d, followers[d].read())
    try:
        while follow:
            ended = (run_dir / FINAL_NAME).exists()  # before the last read: nothing is missed
            for d in pod_dirs(run_dir):
                if replica is None or replica in (d.name, label_of(d.name)):
                    show(d, followers.setdefault(d, _Follower(d / LOG_NAME)).read())
            if ended:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
    finally:
        for f in followers.values():
            f.close()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain logs",
        description="Print the replicas' logs of a `ringtrain run` run dir "
        "(<run dir>/pods/<pod>/log, rotated at 10 MiB into log.1). A cluster job's: "
        "`ringtrain logs JOB --backend kubernetes`.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="the run dir `ringtrain run` printed, or a job name: its newest "
        ".ringtrain/runs/<job>-<time> here",
    )
    replica_args(p)
    return p


def replica_args(p: argparse.ArgumentParser) -> None:
    """``--replica`` and ``--follow``, shared with the client's ``logs`` so a local run and a
    cluster job take the same options."""
    p.add_argument(
        "--replica",
        metavar="NAME",
        help="one replica, e.g. worker-0 or its pod name (default: every replica, each line "
        "prefixed with its name)",
    )
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new output until the job ends (or Ctrl-C)",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run_dir = resolve_run_dir(args.run_dir, Path.cwd())
    if run_dir is None:
        print(
            f"ringtrain logs: {args.run_dir} is neither a run dir of `ringtrain run` (it holds "
            "pods/<pod>/log) nor a job with one under .ringtrain/runs here; a cluster job's "
            "logs: ringtrain logs JOB --backend kubernetes [-n NAMESPACE]",
            file=sys.stderr,
        )
        return 2
    return print_logs(run_dir, args.replica, args.follow, sys.stdout)
