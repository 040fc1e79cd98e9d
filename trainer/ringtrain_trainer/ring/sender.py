"""The ring's send thread: what the calling thread's non-blocking writes could not take, in
order (``engine`` hands it headers, byte ranges and one completion event per collective).
"""

from __future__ import annotations

import queue
import threading

from ringtrain_trainer.ring.protocol import OpHeader
from ringtrain_trainer.ring.transport import LinkError, Transport


class Sender:
    """The send thread: executes an ordered queue of headers, byte ranges and completion
    events. After a failure it keeps draining (setting events) so the receiver never waits on
    it, and it aborts the transport so that the receiver's blocking call returns at once.

    Every collective ends with exactly one completion event, but not every collective sends:
    in a broadcast the rank whose right neighbour is the root only receives. The transport's
    ``end_send`` is therefore called only when this collective's header opened a send
    (``begin_send``); otherwise the event is just set. An exception that is not a
    ``LinkError`` (a bug) breaks the ring like a link failure instead of killing the thread,
    which would leave the communication thread waiting for an event nobody sets."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: LinkError | None = None
        self._open = False  # a begin_send of the current collective awaits its end_send
        self._thread = threading.Thread(target=self._run, name="ring-sender", daemon=True)
        self._thread.start()

    def put(self, item: OpHeader | memoryview | threading.Event | None) -> None:
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                opened, self._open = self._open, False
                if opened and self.error is None:
                    self._do(self._transport.end_send)
                item.set()
            elif self.error is None:
                if isinstance(item, OpHeader):
                    self._open = True
                    self._do(self._transport.begin_send, item)
                else:
                    self._do(self._transport.send, item)

    def _do(self, method, *args) -> None:
        try:
            method(*args)
        except LinkError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a dead send thread would hang the ring
            self._fail(LinkError(f"send thread failed: {type(e).__name__}: {e}"))

    def _fail(self, e: LinkError) -> None:
        self.error = e
        self._transport.abort()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
