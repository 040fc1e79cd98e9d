"""The small interface between the ring algorithm (``engine``) and a wire (``tcp``, ``grpc``).

A rank only ever talks to its two neighbours: it sends to the right and receives from the left.
The engine drives the send side from one thread and the receive side from another, so each
transport needs only two ordered, one-directional operations per collective. Receiving is
split into ``recv_copy`` and ``recv_add`` so a transport can reduce straight from whatever
buffer the bytes arrived in (a preallocated one for TCP, gRPC's own ``bytes`` for gRPC).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ringtrain_trainer.ring.protocol import OpHeader


class LinkError(Exception):
    """The connection to a neighbour broke (closed, reset) or carried something unexpected.

    ``send_side`` marks a failure of the link to the right neighbour that surfaced on the
    receive side (a transport that aborts its receiver when its send call dies), so the
    error names the right peer.
    """

    def __init__(self, message: str, *, send_side: bool = False) -> None:
        super().__init__(message)
        self.send_side = send_side


class LinkTimeout(LinkError):
    """A neighbour sent or accepted nothing within the step timeout."""


class Transport(ABC):
    """This rank's two ring links. Send methods are called from one thread, receive methods
    from another, each in collective order.

    Per collective the send side is either ``begin_send``, ``send``…, ``end_send`` or nothing
    at all (a rank that only receives, such as the one whose right neighbour is a broadcast's
    root); ``end_send`` is never called without the ``begin_send`` of the same collective."""

    #: The data path's name, the ``transport`` label of the ``ringtrain_ring_*`` metrics.
    name = "custom"

    @abstractmethod
    def begin_send(self, header: OpHeader) -> None:
        """Announce a collective to the right neighbour."""

    @abstractmethod
    def send(self, data: memoryview) -> None:
        """Send raw bytes to the right neighbour (the buffer is not modified meanwhile)."""

    def end_send(self) -> None:  # noqa: B027 - an optional hook: a no-op unless overridden
        """The collective's last chunk has been handed to ``send``; only after ``begin_send``."""

    def send_now(self, parts: list[memoryview], with_header: bool = False) -> int | None:
        """Write ``parts`` in order from the calling thread as far as the wire takes them
        *without blocking*; return how many bytes went out. ``None`` (this default): the
        transport cannot, so the engine uses ``begin_send``/``send``/``end_send`` on its send
        thread. A transport that returns a number is one whose ``begin_send`` only writes
        ``header.pack()`` and whose ``end_send`` does nothing: the engine then writes the
        packed header itself, merged with the first chunk, and what did not fit goes through
        ``send`` on the send thread. Saves small collectives the hand-off to that thread.
        ``with_header``: ``parts[0]`` is the header (a transport that moves chunks other than
        as bytes on the wire must tell it from a chunk of the same length)."""
        return None

    @abstractmethod
    def begin_recv(self, header: OpHeader) -> None:
        """Wait for the left neighbour's announcement of ``header``; refuse any other."""

    @abstractmethod
    def recv_copy(self, out: np.ndarray) -> None:
        """Receive exactly ``out.nbytes`` into ``out``."""

    @abstractmethod
    def recv_add(self, out: np.ndarray) -> None:
        """Receive ``out.size`` float32 values and add them into ``out`` in place."""

    def recv_add_send(self, out: np.ndarray) -> bool:
        """Receive ``out.size`` values, add ``out`` to them and send the sum to the right
        neighbour *instead of* storing it (a reduce-scatter step whose partial sum only passes
        through: the allgather overwrites ``out``), if the transport can do that without
        blocking on the send side; ``False`` (this default): nothing was received, the engine
        calls ``recv_add`` and sends ``out`` itself. Only while the calling thread sends."""
        return False

    def end_recv(self) -> None:  # noqa: B027 - an optional hook: a no-op unless overridden
        """Every chunk of the collective has been received."""

    @abstractmethod
    def abort(self) -> None:
        """Break both links now so that a thread blocked on either returns with an error."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, servers and threads; idempotent."""
