"""An elastic job's resize as a phase of the lifecycle fold (pure; issue 38, decision 0217).

The job handed to the fold is already the job at the count its spec asks for, with its share of
the global batch of its creation (:func:`.elastic.running_at`). This phase records that global
batch the first time (status.elastic), notices when the count differs from the one the pods run
at, and asks for the size annotation to be patched onto every worker pod that stays; the pods of
workers beyond the new count are deleted and the missing ones created by the phases after it,
as for any job. The workers do the rest in their containers (``ringtrain_trainer.elastic``): stop
after the same step, the chief checkpoints, re-form the ring at the new size. The resize is done
when the chief reports a ring of the new size (status.progress.ringSize).
"""

from __future__ import annotations

from . import elastic, manifests
from .job import Job
from .status import CREATED, RESTARTING, RUNNING, Fold, Seen, format_time, parse_time

REASON_RESIZING = "Resizing"
REASON_RESIZED = "Resized"
REASON_REFUSED = "ElasticEditRefused"


def phase(f: Fold, job: Job, seen: Seen) -> bool:
    """Never settles the job: the phases after it create and delete the pods."""
    e, worker = job.elastic, job.replica("worker")
    if e is None or job.trainer is None or worker is None:
        return False
    rec = f.status.get(elastic.STATUS_KEY)
    if not isinstance(rec, dict):
        f.status[elastic.STATUS_KEY] = elastic.admitted(job)
        return False
    if e.refused and rec.get("refused") != e.refused:
        f.emit(True, REASON_REFUSED, e.refused)
    if e.refused:
        rec["refused"] = e.refused
    else:
        rec.pop("refused", None)
    n = worker.replicas
    if rec.get("workers") != n and f.state in (CREATED, RUNNING, RESTARTING):
        before = rec.get("workers")
        rec.update(workers=n, resizing={"from": before, "to": n, "since": format_time(f.now)})
        f.emit(
            False,
            REASON_RESIZING,
            f"resizing from {before} to {n} workers, keeping the global batch "
            f"{e.global_batch} ({e.global_batch // n} a worker): the ring stops after its "
            "current step, worker 0 checkpoints it, and the workers that stay re-form the ring "
            "in their pods",
        )
    elif rec.get("workers") != n:
        rec["workers"] = n  # not started, or ended: nothing runs to resize
    _patch_sizes(f, job, seen)
    _done(f, rec)
    return False


def _patch_sizes(f: Fold, job: Job, seen: Seen) -> None:
    """Every live worker pod that stays and carries a size other than the job's: patched (a
    restarted operator finishes a resize it began)."""
    for p in seen.live:
        if p.role != "worker" or p.name not in seen.desired or p.elastic is None:
            continue
        want = elastic.size_document(job, manifests.tf_config(job, p.role, p.index))
        if p.elastic != want:
            f.annotate.append((p.name, want))


#: how soon to look again while a resize is under way (the chief's /status tells it done)
LOOK_AGAIN_S = 1.0


def _done(f: Fold, rec: dict) -> None:
    """Done when the chief reports the ring of the new size; ``step`` is the step the new ring
    went on from, ``seconds`` from the operator's patch to the chief's report seen (within
    :data:`LOOK_AGAIN_S`), ``ringSeconds`` the chief's own: its first sight of the new size to
    the new ring formed."""
    r = rec.get("resizing")
    progress = f.status.get("progress") or {}
    if not isinstance(r, dict):
        return
    if progress.get("ringSize") != r.get("to"):
        f.requeue.append(LOOK_AGAIN_S)
        return
    seconds = (f.now - parse_time(r["since"])).total_seconds()
    last = {
        "from": r.get("from"),
        "to": r.get("to"),
        "step": progress.get("resizeStep", progress.get("step")),
        "seconds": round(seconds, 1),
    }
    if "resizeSeconds" in progress:
        last["ringSeconds"] = progress["resizeSeconds"]
    rec.pop("resizing")
    rec.update(resizes=int(rec.get("resizes", 0)) + 1, lastResize=last)
    f.emit(
        False,
        REASON_RESIZED,
        f"resized from {last['from']} to {last['to']} workers in {seconds:.0f} s; training "
        f"goes on from step {last['step']}",
    )
