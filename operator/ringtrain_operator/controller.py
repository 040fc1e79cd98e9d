"""The reconcile loop, controller-runtime style: a work queue of job keys and a bounded pool.

It replaces one kopf daemon per TrainingJob (an asyncio task, its kopf memory and a thread hop
per wake-up, per job; issue 22). A key is queued at most once however many events arrive for it
(they coalesce), and one worker at a time handles it, so two decisions about one job still never
race; a key added while it is being handled is handled again right after. Each job's next look
(its state's poll, deadline, TTL, failure backoff: :func:`status.look_again_s`) is one timer,
replaced by every reconcile, as the daemon's timeout was.

:data:`WORKERS` reconciles run at once, on their own threads: that bound, not the number of
jobs, is what the API server sees from the operator, and failing jobs back off per job
(:func:`status.error_retry_s`), controller-runtime's per-item rate limiter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

#: Reconciles in flight at once. Each mostly waits on the API server (a job's first reconcile
#: is four round trips: get, status, Service and Secret, pods), so the pool bounds the requests
#: in flight rather than the operator's CPU.
WORKERS = 16


class WorkQueue:
    """Keys to handle: deduplicated, one handler per key at a time, delayed adds as timers.
    Not thread-safe: other threads add through ``loop.call_soon_threadsafe``."""

    def __init__(self) -> None:
        self._ready: asyncio.Queue[Hashable] = asyncio.Queue()
        self._queued: set[Hashable] = set()
        self._active: set[Hashable] = set()
        self._again: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, key: Hashable) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.put_nowait(key)

    def add_after(self, key: Hashable, delay_s: float | None) -> None:
        """Look at ``key`` again in ``delay_s`` (None: only when something adds it), replacing
        the timer an earlier reconcile set."""
        if timer := self._timers.pop(key, None):
            timer.cancel()
        if delay_s is not None:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(delay_s, self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: Hashable) -> None:
        """The object is gone: no timer; a queued entry finds nothing and ends."""
        self.add_after(key, None)
        self._again.discard(key)

    async def get(self) -> Hashable:
        key = await self._ready.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)


class Controller:
    """``WORKERS`` tasks taking keys off one :class:`WorkQueue` and running ``handle(key)`` on
    a thread; ``handle`` returns the seconds until the key's next look (None: none) and
    ``after`` runs on the loop with its result. Nothing runs until ``ready()`` returns."""

    def __init__(
        self,
        handle: Callable[[Any], Any],
        after: Callable[[Any, Any], float | None],
        ready: Callable[[], Awaitable[None]],
        workers: int = WORKERS,
    ) -> None:
        self.handle, self.after, self.ready, self.workers = handle, after, ready, workers
        self.queue = WorkQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._pool: ThreadPoolExecutor | None = None
        #: The pod informer whose cache the reconciles read, and the job informer (set by
        #: whoever starts them); stopped with the workers.
        self.informer: Any = None
        self.jobs: Any = None

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    def start(self) -> None:
        """Spawn the workers from the running loop."""
        if self._tasks:
            return
        self.loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self.workers, "reconcile")
        self._tasks = [asyncio.ensure_future(self._work()) for _ in range(self.workers)]

    def add_threadsafe(self, key: Hashable) -> None:
        """Queue ``key`` from another thread (the pod informer's)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.add, key)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for informer in (self.informer, self.jobs):
            if informer is not None:
                informer.stop()

    async def _work(self) -> None:
        await self.ready()
        loop = asyncio.get_running_loop()
        while True:
            key = await self.queue.get()
            try:
                result = await loop.run_in_executor(self._pool, self.handle, key)
                self.queue.add_after(key, self.after(key, result))
            except Exception:  # never lose a worker: handle() reports its own failures
                log.exception("%s: reconcile worker failed", key)
            finally:
                self.queue.done(key)
