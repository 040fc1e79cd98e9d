"""Resizing a running ``ringtrain run`` of an elastic job (spec.elasticPolicy, decision 0213).

How a resize is asked for: ``ringtrain scale RUN_DIR --workers N`` writes ``RUN_DIR/scale.json``
(``{"workers": N}``, atomically; anything may write it so), the local stand-in for ``kubectl
patch`` of the job's Worker replicas. The runner looks at the file once per turn (a ``stat``,
turns are at most 0.2 s apart) and carries a new count out in three moves:

1. the job at N workers (:func:`ringtrain_operator.elastic.resized`: the same global batch, a
   worker's batch its share) is planned as any job — the operator's admission, new loopback
   ports, a new TF_CONFIG; a count the policy refuses is reported and nothing stops;
2. the ring gets SIGTERM: each worker finishes its step, the stop vote travels through that
   step's allreduce so that every worker stops after the same step, the chief checkpoints that
   step and all exit 143 (``ringtrain_trainer.worker``: the trainer's ordinary stop);
3. the operator's fold creates the new gang as it creates any missing pod; worker 0 (same pod
   name, same checkpoint volume) restores that checkpoint and broadcasts it: the same step,
   the next unseen sample (the sample order depends on the global batch only), the same
   global batch.

Every process of the ring starts again, the survivors too: a process's TF_CONFIG is its
environment, fixed at its start. When the new chief reports its first step the runner prints a
``resized`` event: old → new, the step, the stop and start times (the "resize time" of issue 38).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringtrain import events, files
from ringtrain.errors import InvalidSpec, RingtrainError
from ringtrain_operator import elastic
from ringtrain_operator import spec as jobspec
from ringtrain_operator.job import ElasticPolicy

from .jobstate import WorkerState
from .logs import RUN_NAME, ReplicaLog
from .plan import Replica

if TYPE_CHECKING:
    from .supervisor import Runner

#: The request file in the run dir: ``{"workers": N}``.
REQUEST_NAME = "scale.json"
#: A request is a line of JSON; anything larger is not one.
MAX_REQUEST_BYTES = 4096
#: run.json names a few replicas and ports; 1 MiB is far more than any.
MAX_RUN_BYTES = 1 << 20

Planner = Callable[[Mapping[str, Any]], tuple[jobspec.Job, list[Replica]]]


def request(run_dir: Path, workers: int) -> Path:
    """Ask the run in ``run_dir`` to resize to ``workers``; the file the runner reads."""
    path = run_dir / REQUEST_NAME
    body = {"workers": workers, "requested_ns": time.time_ns()}
    files.atomic_write(path, (json.dumps(body) + "\n").encode())
    return path


def read_request(run_dir: Path) -> int | None:
    """The worker count asked for, or None (no file, or not a request: never trusted)."""
    try:
        raw = files.read_regular(run_dir / REQUEST_NAME, MAX_REQUEST_BYTES, "scale request")
        n = json.loads(raw)["workers"]
    except (OSError, files.Refused, ValueError, KeyError, TypeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


@dataclass
class Pending:
    """A resize carried out, waiting for the new chief's first step to report it."""

    old: int
    new: int
    step: int | None
    asked_s: float
    stopped_s: float


class Resizer:
    """Watches the run dir's request and resizes the runner's ring (the module's three moves).

    ``obj`` is the job as written (``elastic.resized`` rewrites it); ``planner`` plans an
    object into replicas, as ``ringtrain run`` planned the first (same run dir, same sources).
    """

    def __init__(self, obj: Mapping[str, Any], planner: Planner):
        self.obj, self.planner = obj, planner
        #: the request file handled last, as (inode, mtime_ns, size): each request is a new file
        self.seen: tuple[int, int, int] | None = None
        self.pending: Pending | None = None

    def turn(self, runner: Runner) -> None:
        """Once per runner turn: a new request is carried out now (the runner waits for it)."""
        path = runner.run_dir / REQUEST_NAME
        try:
            st = path.stat()
        except OSError:
            return
        if (st.st_ino, st.st_mtime_ns, st.st_size) == self.seen:
            return
        self.seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        n, old = read_request(runner.run_dir), _workers(runner.job)
        if n is None or n == old:
            return
        asked = time.monotonic()
        try:
            obj = elastic.resized(self.obj, runner.job.elastic, n)
            job, replicas = self.planner(obj)
        except (RingtrainError, OSError) as e:  # a refusal never stops the run, nor the ring
            runner.output.message(f"resize to {n} workers refused: {e}")
            runner.output.event({"event": "resize_refused", "workers": n, "message": str(e)})
            return
        runner.output.message(
            f"resizing {old} -> {n} workers: the ring stops after its current step, the chief "
            "checkpoints it"
        )
        ring = [r for r in runner.replicas if r.role in ("chief", "worker")]
        stopping = [r.name for r in ring if r.label in runner.procs]
        runner._delete(stopping)  # SIGTERM: the step, the agreed stop, the checkpoint, 143
        final = runner.state.final
        step = final.steps if final is not None and final.terminated else None
        self.obj = obj
        adopt(runner, job, replicas, ring)
        self.pending = Pending(old, n, step, asked, time.monotonic())
        at = f"step {step}" if step is not None else "its last checkpoint"
        runner.output.message(f"resize {old} -> {n} workers: resuming from {at}")

    def observe(self, runner: Runner, event: events.Event | None) -> None:
        """The chief printed ``event``: its first step at the new size ends the resize; a
        final line first (asked for as training ended: nothing was left to train at the new
        size) ends it with ``first_step`` null."""
        p = self.pending
        if p is None:
            return
        if isinstance(event, events.Final) and not event.terminated:
            first = None
        elif isinstance(event, events.Progress) and isinstance(event.step, int):
            if p.step is not None and event.step <= p.step:
                return
            first = event.step
        else:
            return
        now = time.monotonic()
        self.pending = None
        record = {
            "event": "resized",
            "from": p.old,
            "to": p.new,
            "step": p.step,
            "first_step": first,
            "stop_s": round(p.stopped_s - p.asked_s, 3),
            "start_s": round(now - p.stopped_s, 3),
            "duration_s": round(now - p.asked_s, 3),
        }
        runner.output.event(record)
        runner.output.message(
            f"resized {p.old} -> {p.new} workers at step {p.step}: {record['duration_s']} s "
            f"(stop and checkpoint {record['stop_s']} s, start to the first step "
            f"{record['start_s']} s)"
        )


def _workers(job: jobspec.Job) -> int:
    w = job.replica("worker")
    return w.replicas if w is not None else 0


def adopt(
    runner: Runner, job: jobspec.Job, replicas: list[Replica], stopped: Sequence[Replica]
) -> None:
    """The runner's job becomes ``job``: the stopped ring's processes are forgotten (not
    restarts: the fold creates the new gang as a new job's pods), the new replicas get their
    logs and fresh health. What did not stop (an evaluator) is kept as it runs."""
    gone = {r.label for r in stopped}
    for label in gone:
        runner.procs.pop(label, None)
        runner.pumps.pop(label, None)
        runner.restart_counts.pop(label, None)
        runner.last.pop(label, None)
        runner.due.pop(label, None)
        runner.state.workers.pop(label, None)
        if (log := runner.logs.pop(label, None)) is not None:
            log.close()
    runner.job, runner.replicas = job, replicas
    runner.by_name = {r.name: r for r in replicas}
    now = time.monotonic()
    for r in replicas:
        if r.label in gone or r.label not in runner.state.workers:
            runner.state.workers[r.label] = WorkerState(last_output_s=now)
        if r.log and r.label not in runner.logs:
            runner.logs[r.label] = ReplicaLog(Path(r.log))
    runner.state.new_gang([], now)
    with contextlib.suppress(OSError, ValueError):  # `ringtrain status` reads the replicas here
        run = json.loads((runner.run_dir / RUN_NAME).read_text())
        run["replicas"] = {
            r.label: {"pod": r.name, "metrics_port": r.metrics_port, "log": r.log} for r in replicas
        }
        run["elastic"] = record(job)
        files.atomic_write(runner.run_dir / RUN_NAME, (json.dumps(run) + "\n").encode())


def record(job: jobspec.Job) -> dict | None:
    """What ``ringtrain scale`` checks a count against, kept in the run's ``run.json``: the
    policy and the count the ring runs at (None: not an elastic job)."""
    e = job.elastic
    if e is None:
        return None
    return {
        "minReplicas": e.min_replicas,
        "maxReplicas": e.max_replicas,
        "globalBatch": e.global_batch,
        "workers": _workers(job),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain scale",
        description="Resize a running `ringtrain run` of an elastic job (spec.elasticPolicy): "
        "the ring stops after its current step, the chief checkpoints it, and the job goes on "
        "from there with N workers and the same global batch. The run reports it as a "
        "'resized' event, or a refusal.",
    )
    p.add_argument("run_dir", type=Path, help="the run dir `ringtrain run` printed")
    p.add_argument("--workers", type=int, required=True, metavar="N", help="the new count")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit 0: asked (or already at that count); 2: no run there, or a count its policy refuses
    (the runner checks again, with the whole admission, before it stops anything)."""
    args = parser().parse_args(argv)
    try:
        run = json.loads(
            files.read_regular(args.run_dir / RUN_NAME, MAX_RUN_BYTES, "run.json").decode()
        )
    except (OSError, files.Refused, ValueError):
        run = None
    if not isinstance(run, dict):
        print(f"ringtrain scale: {args.run_dir} is no `ringtrain run`'s run dir", file=sys.stderr)
        return 2
    e, name = run.get("elastic"), run.get("job")
    try:
        policy = (
            ElasticPolicy(e["minReplicas"], e["maxReplicas"], None, e["globalBatch"])
            if isinstance(e, dict)
            else None
        )
        elastic.check_count(policy, args.workers)
    except (InvalidSpec, KeyError, TypeError) as why:
        print(f"ringtrain scale: job {name}: {why}", file=sys.stderr)
        return 2
    current = e.get("workers") if isinstance(e, dict) else None
    if current == args.workers:
        print(f"ringtrain scale: job {name} runs {args.workers} workers already")
        return 0
    path = request(args.run_dir, args.workers)
    print(
        f"ringtrain scale: job {name}: asked for {current} -> {args.workers} workers ({path}); "
        "the run reports it as a 'resized' event"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
