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
REASON_LOST = "WorkerLost"
REASON_RETURNED = "WorkerReturned"


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
    _losses(f, job, seen, rec)
    if rec.get("growing") != n:
        rec.pop("growing", None)
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


def kept(f: Fold, job: Job) -> set[str]:
    """Pods beyond the count that stay: while the job goes on without a lost worker, that
    worker's pod (pending its node), whose running is what grows the job back."""
    rec = f.status.get(elastic.STATUS_KEY) or {}
    worker = job.replica("worker")
    if worker is None or rec.get("shrunkTo", rec.get("growing")) != worker.replicas:
        return set()
    return {job.pod_name("worker", worker.replicas)}


def _losses(f: Fold, job: Job, seen: Seen, rec: dict) -> None:
    """Shrink on loss (issue 38): a worker after worker 0 whose pod has not been running and
    ready for ``shrinkAfterSeconds`` while the job runs → the job goes on with the workers
    before it (``status.elastic.shrunkTo``, which :func:`.elastic.running_at` reads), down to
    minReplicas; that worker's pod is kept (:func:`kept`) and, once it runs, the job grows back
    to its count."""
    e, worker = job.elastic, job.replica("worker")
    assert e is not None and worker is not None
    n, live = worker.replicas, {p.name: p for p in seen.live}
    shrunk = rec.get("shrunkTo")
    if shrunk == n:
        back = live.get(job.pod_name("worker", n))
        if back is None or back.phase == "Running":
            rec["growing"] = rec.pop("shrunkTo")  # kept until the job is at its count again
            why = "is running again" if back is not None else "is gone (deleted)"
            f.emit(
                False,
                REASON_RETURNED,
                f"{job.pod_name('worker', n)} {why}: the job grows back to its count",
            )
        return
    in_place = any(p.elastic is not None for p in seen.live if p.role == "worker")
    if f.state not in (RUNNING, RESTARTING) or not in_place:
        # a job starting waits for its pods; pods that cannot learn a size in place (the
        # processes of ``ringtrain run``, resized by ``ringtrain scale``) are not shrunk around
        rec.pop("lost", None)
        return
    names = {job.pod_name("worker", i) for i in range(1, n)}
    lost = {k: v for k, v in (rec.get("lost") or {}).items() if k in names}  # gone: forgotten
    rec["lost"] = lost
    for i in range(1, n):
        name = job.pod_name("worker", i)
        p = live.get(name)
        if p is not None and p.phase == "Running" and p.ready:
            lost.pop(name, None)
        else:
            lost.setdefault(name, format_time(f.now))
    if not lost:
        rec.pop("lost")
        return
    waited = {name: (f.now - parse_time(since)).total_seconds() for name, since in lost.items()}
    over = sorted(int(k.rsplit("-", 1)[1]) for k, s in waited.items() if s >= e.shrink_after_s)
    if not over:
        f.requeue.append(max(1.0, e.shrink_after_s - max(waited.values())))
    elif e.min_replicas <= over[0] < n:  # below minReplicas the job waits for it, as any job
        k = over[0]
        rec["shrunkTo"] = k
        rec.pop("lost")
        f.emit(
            True,
            REASON_LOST,
            f"{job.pod_name('worker', k)} has not been running for {e.shrink_after_s} s "
            f"(spec.elasticPolicy.shrinkAfterSeconds): the job goes on with {k} worker"
            f"{'s' if k > 1 else ''} until it runs again",
        )
        f.requeue.append(LOOK_AGAIN_S)


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
