"""The process supervisor: carries out the operator's decisions with processes instead of Pods.

Pipeline position: after planning, `ringtrain run` hands the replicas to a :class:`Runner`.
It decides with the operator's own fold (:func:`lifecycle.derive_status`): the processes are
presented as observed Pods, and the runner starts and stops them as the returned decision
creates and deletes Pods. So restartPolicy, restarts in place, backoffLimit,
activeDeadlineSeconds and successPolicy mean here exactly what they mean on a cluster.

The runner is the kubelet too: under the Pod restartPolicy OnFailure/Always (every replica
restartPolicy but Never) a process that exits is started again in place — same replica, same
per-replica emptyDir directories, so the chief resumes from its own checkpoints — after the fold
has seen the exit (as the operator sees ``state.terminated``), so a permanent code fails the job
before any restart. Its peers leave the broken ring (138) and are restarted the same way. The
back-off between restarts of one replica is the kubelet's shape, shorter: none before the first,
then 1 s doubling to 30 s (the kubelet: 10 s to 5 min).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

from ringtrain import events
from ringtrain_operator import lifecycle, status
from ringtrain_operator import spec as jobspec

from .console import Output
from .jobstate import JobState, WorkerState
from .logs import RECREATED_MARK, RESTART_MARK, ReplicaLog
from .plan import CHECKPOINT_VOLUME, Replica
from .pods import (  # noqa: F401 (re-exported: cli and tests import them from here)
    exit_status,
    observed_pod,
    read_result,
    restarts_in_place,
)

#: How long replicas get between SIGTERM and SIGKILL (Kubernetes' default grace period is 30 s;
#: locally nobody wants to wait that long for a process that ignores SIGTERM).
DEFAULT_GRACE_S = 10.0
#: Restart back-off of one replica: (first delay, cap) in seconds; the first restart is at once.
RESTART_BACKOFF_S = (1.0, 30.0)


class Resizes(Protocol):
    """An elastic job's resizes (:class:`.resize.Resizer`): a look each turn, the chief's lines."""

    def turn(self, runner: Runner) -> None: ...
    def observe(self, runner: Runner, event: events.Event | None) -> None: ...


class Stopped(Exception):
    """The runner received SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Runner:
    """Carries out the operator's decisions with processes instead of Pods.

    Each turn observes the current processes as Pods (:func:`observed_pod`), folds them with the
    job's previous status through :func:`lifecycle.derive_status` — the operator's own lifecycle:
    restart policies, restarts in place, backoffLimit, activeDeadlineSeconds, successPolicy — and
    does what the decision says: start the replicas it creates, stop the ones it deletes; then,
    as the kubelet, starts again in place what exited under OnFailure/Always. So a
    job behaves here as it would on a cluster, with one implementation of the rules.
    """

    def __init__(
        self,
        job: jobspec.Job,
        replicas: list[Replica],
        run_dir: Path,
        output: Output,
        grace_s: float = DEFAULT_GRACE_S,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.job, self.replicas, self.run_dir, self.output = job, replicas, run_dir, output
        self.grace_s, self.clock = grace_s, clock
        #: SIGINT/SIGTERM received (:meth:`request_stop`), raised as Stopped by :meth:`wait`
        self.stop_signal: int | None = None
        self.by_name = {r.name: r for r in replicas}
        #: The current process of each replica (label → process); a restart replaces one.
        self.procs: dict[str, subprocess.Popen] = {}
        self.pumps: dict[str, threading.Thread] = {}
        #: The kubelet's view of each replica: restartCount, the previous process (lastState),
        #: and when a pending restart in place is due (monotonic seconds).
        self.restart_counts: dict[str, int] = {}
        self.last: dict[str, subprocess.Popen] = {}
        self.due: dict[str, float] = {}
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        #: Each replica's output kept in its pod directory (``ringtrain logs``).
        self.logs = {r.label: ReplicaLog(Path(r.log)) for r in replicas if r.log}
        self.state = JobState(
            total_steps=job.trainer.steps if job.trainer else None,
            started_s=time.monotonic(),
            workers={r.label: WorkerState() for r in replicas},
        )
        # an MPI job's rank 0 prints through its launcher's mpirun
        self.chief_label = "launcher-0" if job.mpi else f"{job.chief[0]}-{job.chief[1]}"
        #: The TrainingJob's status as the operator would write it (state, conditions, restarts).
        self.status: dict[str, Any] = {}
        self.started = False
        #: an elastic job's resizes (:mod:`.resize`); None: the job's size is fixed
        self.resizer: Resizes | None = None

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
        log = self.logs.get(label)
        for line in stream:
            line = line.rstrip("\n")
            if log is not None:
                log.write(line)
            self.lines.put((label, line))
        self.lines.put((label, None))

    def close_logs(self) -> None:
        for log in self.logs.values():
            log.close()

    def _create(self, names: Iterable[str]) -> None:
        """Start the named replicas: what the kubelet does with a newly created Pod."""
        todo = [self.by_name[n] for n in names]
        for r in todo:
            self._materialize(r)
        # a new gang after a restart: old progress no longer applies (an MPI job's launcher,
        # created after its workers, starts the first)
        if self.started and todo and any(r.label in self.restart_counts for r in todo):
            self.state.new_gang([r.label for r in todo], time.monotonic())
            resume = (
                f", resuming from the latest checkpoint in {self.run_dir / CHECKPOINT_VOLUME}"
                if self.job.trainer
                else ""
            )
            self.output.message(f"restart {self.restarts}: starting {len(todo)} replicas{resume}")
        for r in todo:
            again = r.label in self.restart_counts
            self.restart_counts[r.label] = 0
            self.last.pop(r.label, None)
            self._start(r, RECREATED_MARK.format(label=r.label, n=self.restarts) if again else None)
        self.started = self.started or bool(todo)

    def _start(self, r: Replica, note: str | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **r.env}
        if r.termination_log:  # a new container's: an old run's words must not explain this one
            with contextlib.suppress(FileNotFoundError):
                os.unlink(r.termination_log)
        if note and r.label in self.logs:
            self.logs[r.label].write(note)
        # Own session: a terminal's Ctrl-C reaches only the runner, which then stops every
        # replica the same way (SIGTERM, grace, SIGKILL) — as the kubelet does.
        p = subprocess.Popen(
            r.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",  # a replica's stray byte is logged as U+FFFD, never a traceback
            bufsize=1,
            start_new_session=True,
            cwd=self.run_dir,
        )
        self.procs[r.label] = p
        t = threading.Thread(
            target=self._pump, args=(r.label, p.stdout), daemon=True, name=f"pump-{r.label}"
        )
        t.start()
        self.pumps[r.label] = t
        self.output.event(
            {
                "event": "started",
                "replica": r.label,
                "pod": r.name,
                "pid": p.pid,
                "restarts": self.restarts,
            }
        )

    def _restart_in_place(self, now_s: float, seen: set[str]) -> None:
        """The kubelet's part: start exited replicas again in place once their back-off is
        over. Their directories are kept: the chief finds its checkpoints where it left them.
        Only exits in ``seen``, those the operator's fold has just observed: one that happened
        since waits a turn, so a permanent exit code fails the job before any restart."""
        for r in self.replicas:
            p = self.procs.get(r.label)
            if (
                p is None
                or r.label not in seen
                or p.poll() is None
                or not restarts_in_place(r, p.returncode)
            ):
                continue
            n = self.restart_counts.get(r.label, 0)
            due = self.due.setdefault(
                r.label,
                now_s
                + (
                    0.0
                    if n == 0
                    else min(RESTART_BACKOFF_S[0] * 2 ** (n - 1), RESTART_BACKOFF_S[1])
                ),
            )
            if now_s < due:
                continue
            del self.due[r.label]
            self.pumps[r.label].join(timeout=self.grace_s)  # its last lines are its own
            self._drain()
            self.state.workers[r.label].exit_code = exit_status(p.returncode)
            self.output.message(
                f"{r.label} exited with {exit_status(p.returncode)}: restarting "
                f"it in place (restart {n + 1} of the replica)"
            )
            if r.label == self.chief_label:
                self.state.new_gang([r.label], now_s)  # it resumes from its checkpoint
            else:
                self.state.workers[r.label] = WorkerState(last_output_s=now_s)
            self.restart_counts[r.label], self.last[r.label] = n + 1, p
            self._start(r, RESTART_MARK.format(label=r.label, n=n + 1))

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
        chief = label == self.chief_label
        event = events.parse_line(line)
        self.state.observe(label, event, time.monotonic(), chief=chief)
        if chief and self.resizer is not None:
            self.resizer.observe(self, event)
        if event is None:
            self.output.log(label, line)
        elif (chief and isinstance(event, (events.Eval, events.Final))) or (
            label.startswith("evaluator-") and isinstance(event, (events.Evaluation, events.Final))
        ):
            self.output.log(label, events.format_event(event))

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
        while not stop.wait(period_s):
            ports = {r.label: r.metrics_port for r in self.replicas if r.metrics_port}
            for label, port in ports.items():
                p = self.procs.get(label)
                if p is None or p.poll() is not None:
                    continue
                st = events.fetch_status(f"http://127.0.0.1:{port}/status")
                if st is not None:
                    self.state.observe_status(label, st, time.monotonic())

    def reconcile(self) -> status.Decision:
        """One turn of the operator's loop: observe, fold, act. Returns the decision taken."""
        # exits seen before the fold observes: those, and only those, may restart this turn
        seen = {label for label, p in self.procs.items() if p.poll() is not None}
        pods = [
            observed_pod(
                r, self.procs[r.label], self.restart_counts.get(r.label, 0), self.last.get(r.label)
            )
            for r in self.replicas
            if r.label in self.procs
        ]
        decision = lifecycle.derive_status(self.job, pods, self.clock(), self.status)
        self.status = decision.status
        for e in decision.events:
            self.output.event(
                {
                    "event": "status",
                    "type": e.type,
                    "reason": e.reason,
                    "message": e.message,
                    "phase": self.phase,
                    "restarts": self.restarts,
                }
            )
            if e.type == "Warning":
                self.output.message(f"{e.reason}: {e.message}")
        if self.phase in status.TERMINAL:
            return decision  # what is still running is stopped by the caller (stop())
        self._delete(decision.delete)
        for name in decision.delete:
            del self.procs[self.by_name[name].label]
            self.due.pop(self.by_name[name].label, None)
        self._restart_in_place(time.monotonic(), seen)
        self._create(decision.create)
        return decision

    def progress(self, now_s: float) -> dict:
        return {**self.state.progress(now_s), "phase": self.phase, "restarts": self.restarts}

    def request_stop(self, signum: int) -> None:
        """From a signal handler: :meth:`wait` raises :class:`Stopped` at its next turn (within
        0.2 s). Raising in the handler itself could land inside a queue's lock and hang the
        stop that follows — seen once under load: SIGTERM, and the runner never exited."""
        if self.stop_signal is None:
            self.stop_signal = signum

    def wait(self) -> str:
        """Run until the job is Succeeded or Failed; returns that phase.

        After a success the other ring members get the grace period to finish on their own
        (they run the same number of steps) rather than being stopped at once, so their exit
        codes say how they really ended.
        """
        stop_polling = threading.Event()
        threading.Thread(
            target=self._poll_status, args=(stop_polling,), daemon=True, name="status-poller"
        ).start()
        try:
            while True:
                if self.stop_signal is not None:
                    raise Stopped(self.stop_signal)
                if self.resizer is not None and self.phase not in status.TERMINAL:
                    self.resizer.turn(self)
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
            if self.phase == status.SUCCEEDED and not self.job.mpi:
                self._let_ring_finish()
            return self.phase
        finally:
            stop_polling.set()

    def _let_ring_finish(self) -> None:
        ring = [
            self.procs[r.label]
            for r in self.replicas
            if r.role in ("chief", "worker") and r.label in self.procs
        ]
        end = time.monotonic() + self.grace_s
        for p in ring:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)
