"""This worker's batch for each step, the next one read while the current step computes.

Pipeline position: the worker asks :meth:`Feed.get` for the batch at its data
:class:`~ringtrain_trainer.data.dataset.Position` at the start of every step (inside the
trace's ``data`` span); :attr:`Feed.wait_s` is how long that took — the time the step waited
for data, reported as ``ringtrain_data_wait_seconds`` and ``/status``'s ``data_wait_s``.

Why a thread and two buffers, and only for shards: an in-memory gather is a ``np.take`` of a
few hundred kilobytes, far below a step, so it stays inline (one buffer, nothing shared). A
sharded split reads its rows from files (``rows.ShardedArray``, ``os.preadv``, which releases
the GIL); one background thread fills the *other* preallocated buffer with the next position's
batch while the step runs on this one — tf.data's ``prefetch(1)``, bounded at one batch ahead
so memory is two batches whatever the data set's size. Both buffers are allocated once; a
step allocates nothing of a batch's size. The order is the :class:`Sharder`'s alone, so
prefetching changes no sample and no weight. A position other than the one prefetched (the
first step, a restore) is read inline, after any read in flight has finished: the sharder is
only ever used by one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from ringtrain_trainer.data.dataset import Position, Sharder, batch_into
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.data.split import Split


class Feed:
    def __init__(
        self,
        split: Split,
        sharder: Sharder,
        input_shape: tuple[int, ...],
        make_labels: Callable[[], np.ndarray],
        background: bool | None = None,
    ):
        self.split, self.sharder = split, sharder
        #: read ahead in a thread: by default for shards only (see the module's docstring)
        self.background = (
            isinstance(split.images, ShardedArray) if background is None else background
        )
        b = sharder.batch_size
        stored = split.images
        self._bufs = [
            (
                np.zeros((b, *input_shape), np.float32),
                make_labels(),
                np.zeros((b, *stored.shape[1:]), stored.dtype),
            )
            for _ in range(2 if self.background else 1)
        ]
        #: seconds the last :meth:`get` waited (a read not hidden behind the previous step)
        self.wait_s = 0.0
        self.total_wait_s = 0.0
        self._slot = 0  # the buffer the caller holds
        self._cv = threading.Condition()
        self._job: tuple[Position, int] | None = None
        self._ready: tuple[Position, int, BaseException | None] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def _fill(self, slot: int, pos: Position) -> None:
        x, y, scratch = self._bufs[slot]
        batch_into(self.split, self.sharder.indices(pos.epoch, pos.batch), x, y, scratch)

    def get(self, pos: Position) -> tuple[np.ndarray, np.ndarray]:
        """The batch (inputs, labels) at ``pos`` in buffers valid until the next call; then
        the batch after it starts reading into the other buffer."""
        t0 = time.perf_counter()
        if not self.background:
            self._fill(0, pos)
        else:
            with self._cv:
                while self._job is not None:
                    self._cv.wait()
                ready, self._ready = self._ready, None
            if ready is not None and ready[0] == pos:
                if ready[2] is not None:
                    raise ready[2]
                self._slot = ready[1]
            else:
                self._slot = 1 - self._slot
                self._fill(self._slot, pos)
            self._submit(self.sharder.advance(pos), 1 - self._slot)
        self.wait_s = time.perf_counter() - t0
        self.total_wait_s += self.wait_s
        x, y, _ = self._bufs[self._slot]
        return x, y

    def _submit(self, pos: Position, slot: int) -> None:
        with self._cv:
            if self._closed:
                return
            self._job = (pos, slot)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ringtrain-data-prefetch", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                pos, slot = self._job  # type: ignore[misc]  # not None: the loop above
            error: BaseException | None = None
            try:
                self._fill(slot, pos)
            except BaseException as e:  # noqa: BLE001 - raised by get() if this batch is used
                error = e
            with self._cv:
                self._job, self._ready = None, (pos, slot, error)
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the reader (after the read in flight); idempotent."""
        with self._cv:
            while self._job is not None:
                self._cv.wait()
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
