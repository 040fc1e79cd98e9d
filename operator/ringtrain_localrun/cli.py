"""`ringtrain run JOB.yaml`: a TrainingJob as local processes, one per replica, no cluster.

The same code path as Kubernetes: :mod:`.plan` turns the operator's own Pods into processes,
:mod:`.supervisor` runs them under the operator's own lifecycle fold, :mod:`.jobstate` folds
what they print, :mod:`.console` shows it, :mod:`.logs` keeps each replica's output in the run
dir (the summary, also ``final.json`` there, names it). Outcome → exit code: 0 Succeeded, 1 Failed,
2 invalid job or one this machine cannot run (:mod:`.needs`: nothing started), 130/143 stopped by
SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ringtrain import files
from ringtrain.errors import EXIT_TERMINATED, RingtrainError
from ringtrain_operator import status

from . import needs, resize, sources
from .console import Output, format_summary
from .jobstate import summary, terminal_condition
from .logs import FINAL_NAME, RUN_NAME
from .plan import Replica, plan, read_job
from .supervisor import DEFAULT_GRACE_S, Runner, Stopped, exit_status, read_result

#: Exit codes of `ringtrain run` (the job's outcome, not a replica's).
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def default_run_dir(job_name: str) -> Path:
    """A fresh directory per run: a new run never resumes an old run's checkpoint by surprise."""
    return Path(".ringtrain") / "runs" / f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def explain_paths(message: str | None, replicas: list[Replica]) -> str | None:
    """A failure's message naming a path that ``ringtrain run`` made local says what it was in
    the pod: ``(<local> is /models/m.keras in the pod (volume models, mounted at /models))``."""
    if not message:
        return message
    notes = dict.fromkeys(
        f"{local} is {why}"
        for r in replicas
        for local, why in r.rewritten.items()
        if local in message and not why.startswith("/tmp in the pod")  # HOME: no path of theirs
    )
    return message + "".join(f" ({n})" for n in notes)


def manifest_text(args: argparse.Namespace) -> str:
    try:
        return Path(args.manifest).read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain run",
        description="Run a TrainingJob manifest on this machine: one process per replica, "
        "loopback TF_CONFIG, the operator's own Pod definitions.",
    )
    p.add_argument("manifest", help="YAML file holding one TrainingJob")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line on stdout (progress, then the final result); "
        "replica logs go to stderr",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        help="where checkpoints, tokens and results go (default: a fresh "
        ".ringtrain/runs/<job>-<time>; reuse one to resume from its checkpoint)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="time between SIGTERM and SIGKILL when stopping replicas (default %(default)s)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between progress lines when stdout is not a terminal",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ringtrain run`; returns the exit code of the job's outcome."""
    args = parser().parse_args(argv)
    output = Output(args.json, sys.stdout, sys.stderr, args.progress_interval)
    try:
        obj = read_job(args.manifest)
        name = (obj.get("metadata") or {}).get("name") or "job"
        run_dir = (args.run_dir or default_run_dir(str(name))).resolve()
        beside = sources.read(args.manifest)
        job, replicas = plan(obj, run_dir, sources=beside)
        if (mounted := sources.model_from(job, beside)) is not None:
            print(f"ringtrain run: {args.manifest}: {mounted}", file=sys.stderr)
    except RingtrainError as e:
        if args.json:
            output.event(
                {"event": "final", "phase": "Failed", "reason": "InvalidSpec", "message": str(e)}
            )
        print(f"ringtrain run: invalid TrainingJob: {e}", file=sys.stderr)
        return EXIT_INVALID
    lacking = needs.missing(r.argv for r in replicas)
    if lacking:  # refused here, not as a replica's ModuleNotFoundError retried under OnFailure
        why = needs.message(args.manifest, lacking, needs.needs_command(manifest_text(args)))
        if args.json:
            output.event(
                {"event": "final", "phase": "Failed", "reason": "NotInstalled", "message": why}
            )
        print(f"ringtrain run: {why}", file=sys.stderr)
        return EXIT_INVALID

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINAL_NAME).unlink(missing_ok=True)  # a reused run dir's: `logs -f` waits anew
    runner = Runner(job, replicas, run_dir, output, grace_s=args.grace_period)
    if job.elastic is not None:  # `ringtrain scale RUN_DIR --workers N` resizes it
        runner.resizer = resize.Resizer(obj, lambda o: plan(o, run_dir, sources=beside))
    start = {
        "event": "start",
        "job": job.name,
        "run_dir": str(run_dir),
        "replicas": {
            r.label: {"pod": r.name, "metrics_port": r.metrics_port, "log": r.log} for r in replicas
        },
    }
    output.event(start)
    # who runs it and which replica is the chief: `ringtrain status|wait|delete` and the
    # Python client (ringtrain_client) read it while the run goes on
    with contextlib.suppress(OSError):
        run = {**start, "pid": os.getpid(), "chief": runner.chief_label}
        run["elastic"] = resize.record(job)  # what `ringtrain scale` checks a count against
        files.atomic_write(run_dir / RUN_NAME, (json.dumps(run) + "\n").encode())
    output.message(f"TrainingJob {job.name}: {len(replicas)} replicas, run dir {run_dir}")
    for r in replicas:
        if r.metrics_port:
            output.message(f"  {r.label:<10} metrics http://127.0.0.1:{r.metrics_port}/metrics")

    def on_signal(signum: int, _frame: Any) -> None:
        runner.request_stop(signum)

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
    runner.close_logs()
    if reason is None:
        reason, message = terminal_condition(runner.status)
        message = explain_paths(message, runner.replicas)
    exits = {
        label: None if p.returncode is None else exit_status(p.returncode)
        for label, p in runner.procs.items()
    }
    chief = next(r for r in runner.replicas if r.label == runner.chief_label)
    result = summary(
        job,
        phase,
        runner.state,
        exits,
        run_dir,
        elapsed,
        reason,
        message,
        runner.restarts,
        chief_result=read_result(chief),
    )
    output.progress(runner.progress(time.monotonic()), time.monotonic(), force=True)
    output.event(result)
    output.message("\n" + format_summary(result))
    with contextlib.suppress(OSError):
        files.atomic_write(run_dir / FINAL_NAME, (json.dumps(result) + "\n").encode())
    if reason == "Stopped":
        return EXIT_INTERRUPTED if "SIGINT" in (message or "") else EXIT_TERMINATED
    return EXIT_SUCCEEDED if phase == status.SUCCEEDED else EXIT_FAILED
