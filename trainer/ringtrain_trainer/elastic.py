"""An elastic job's size file: how a worker that stays learns its ring's new size, in its pod.

A process's TF_CONFIG is its environment, fixed when it starts, and a pod's environment cannot
change; so an elastic job's pods (``spec.elasticPolicy``, decision 0217) also carry the job's
current size as a pod annotation, which the kubelet projects into a file through the downward
API (``RINGTRAIN_ELASTIC_FILE``) within a fraction of a second of the operator's patch. The file
holds this replica's TF_CONFIG at that size and its share of the global batch; it wins over the
environment and ``--batch-size`` at start-up (:meth:`.config.TrainerConfig.from_args`).

While training, a :class:`Watcher` reads the file; when it changes, the worker asks the ring to
stop after the current step (the same vote SIGTERM casts: every worker stops after the same
step and the chief checkpoints it) and, once everything is closed, re-executes itself in the same
container (:func:`exec_resized`) — no pod is recreated, no restart counted — to form the ring at
the new size and go on from that checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ringtrain.errors import InvalidSpec

#: the file the pod's downward API volume projects the ``ringtrain.io/elastic`` annotation into
ENV = "RINGTRAIN_ELASTIC_FILE"
#: set for a re-executed worker: ``from,to,step,seen`` (``seen``: the epoch time the change was
#: read), so the new process can say how long the resize took
RESIZED_ENV = "RINGTRAIN_RESIZED"
#: the most the file may hold: a TF_CONFIG of 1024 workers' DNS names is ~90 KiB
MAX_BYTES = 1 << 20
POLL_S = 0.2
#: a stop the ring agreed on that this worker did not ask for, with the file unchanged yet: how
#: long to wait for the change (the kubelet updates it within 0.3 s, measured) before taking it
#: for a peer's pod gone, whose return, or the job's new size, is waited for in a rejoin
SETTLE_S = 3.0


@dataclass(frozen=True)
class Size:
    """One reading of the file."""

    workers: int
    batch_size: int
    tf_config: str
    raw: str


def parse(raw: str, where: str) -> Size:
    """The file's JSON, or :class:`InvalidSpec` naming ``where`` and what is wrong."""
    try:
        doc = json.loads(raw)
        size = Size(int(doc["workers"]), int(doc["batchSize"]), str(doc["tfConfig"]), raw)
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidSpec(f"{ENV} {where}: not an elastic size document ({e!r:.200})") from None
    if size.workers < 1 or size.batch_size < 1:
        raise InvalidSpec(f"{ENV} {where}: workers and batchSize must be positive ({raw:.200})")
    return size


def read(path: str) -> Size:
    """The file as it is now; :class:`InvalidSpec` when it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InvalidSpec(f"{ENV} {path}: cannot read ({e})") from None
    if len(raw) > MAX_BYTES:
        raise InvalidSpec(f"{ENV} {path}: over {MAX_BYTES} bytes")
    return parse(raw.decode(errors="replace"), path)


class Watcher:
    """Reads the file every :data:`POLL_S` in a daemon thread from before the ring forms; the
    first change that parses is kept (:attr:`changed`), sets :attr:`found` (the rendezvous gives
    up on it: ``ring.rendezvous``) and, once a trainer is attached, its ``stop_requested``. A
    file that cannot be read for a moment (the kubelet swaps it atomically, but a node can
    hiccup) is no change."""

    def __init__(self, path: str, started: str):
        self.path, self.started = path, started
        self.changed: Size | None = None
        self.seen_at = 0.0
        self.found = threading.Event()
        self._stop: threading.Event | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-watch", daemon=True)
        self._thread.start()

    def attach(self, stop_requested: threading.Event) -> None:
        """A change stops the trainer's ring after its current step (at once if seen already)."""
        with self._lock:
            self._stop = stop_requested
            if self.changed is not None:
                stop_requested.set()

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                size = read(self.path)
            except InvalidSpec:
                continue
            if size.raw != self.started:
                with self._lock:
                    self.changed, self.seen_at = size, time.time()
                    self.found.set()
                    if self._stop is not None:
                        self._stop.set()
                return

    def after_stop(self, signalled: bool, settle_s: float = SETTLE_S) -> Size | None:
        """The new size to re-form the ring at, or None (stop as any stopped worker). A worker
        that was signalled itself is stopping for good; one that was not may have stopped on a
        peer's vote before its own file changed: it waits up to ``settle_s`` for the change."""
        if self.changed is None and not signalled:
            self.found.wait(settle_s)
        return self.changed

    def close(self) -> None:
        self._closed.set()


def exec_resized(size: Size, before: int, step: int, seen_at: float, drop: str) -> None:
    """Replace this process with the same command line at the new size (never returns): the
    new process reads the file again. The variable ``drop`` (a rejoin count, ``.rejoin``) does
    not carry over."""
    print(
        f"ringtrain worker: the job was resized from {before} to {size.workers} workers; "
        f"re-forming the ring in this container after step {step} (exec, no restart)",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    env = {k: v for k, v in os.environ.items() if k != drop}
    env[RESIZED_ENV] = f"{before},{size.workers},{step},{seen_at:.3f}"
    os.execve(sys.executable, list(sys.orig_argv), env)


@dataclass(frozen=True)
class Resized:
    """What a re-executed worker was told by :func:`exec_resized`."""

    before: int
    after: int
    step: int
    seen_at: float

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Resized | None:
        try:
            a, b, c, d = env.get(RESIZED_ENV, "").split(",")
            return cls(int(a), int(b), int(c), float(d))
        except ValueError:
            return None

    def event(self, ring_at: float, step: int) -> dict:
        """The ``resized`` line the chief prints once the new ring has formed and restored
        ``step`` (the stop step; after a ring broken by a lost worker, its last checkpoint's)."""
        return {
            "event": "resized",
            "from": self.before,
            "to": self.after,
            "step": step,
            "ring_formed_s": round(ring_at - self.seen_at, 3),
        }
