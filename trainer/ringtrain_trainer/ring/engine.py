"""The ring collective: runs ``schedule`` over a ``Transport`` with a send thread and a receive
thread, chunk by chunk.

The calling (communication) thread receives: it waits for each chunk of the phase's receive
segment, reduces or copies it in place, and hands the same element range to the send thread,
because what was just received is exactly what the next phase sends. The send thread streams
those ranges to the right neighbour meanwhile, so sending, receiving and adding overlap at chunk
granularity and the wire never waits for a whole segment. Socket calls and numpy's add release
the GIL, which is what makes two Python threads worth having. Where the transport can write
without blocking (``Transport.send_now``: TCP), the calling thread writes the header, merged
with the first chunk, and every chunk itself for as long as the socket takes them whole; only
from the first that does not fit does the send thread take over. A small collective then
never wakes that thread (measured in docs/ring.md: a third of a 1 MiB allreduce).

Any failure breaks the ring for good: the transport is closed (so neighbours see it at once
instead of waiting for their timeout), every peer is told over the control plane (``Abort``),
and this and every later call raise ``RingError`` or ``PeerTimeout`` naming rank, step and
peer; the worker rejoins the ring in its container (``ringtrain_trainer.rejoin``) or exits with
the retryable code for its kubelet to restart it. The control
plane breaks the ring from outside the same way (:meth:`RingCollective.interrupt`) when a peer
aborts or its watchdog finds a neighbour frozen. Each finished collective and each break is
reported to ``observer`` (a :class:`RingObserver`), which the trainer's metrics replace.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ringtrain import options
from ringtrain.errors import PeerTimeout, RingError
from ringtrain_trainer import trace
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.ring import schedule
from ringtrain_trainer.ring.observer import RingObserver
from ringtrain_trainer.ring.protocol import Kind, OpHeader
from ringtrain_trainer.ring.sender import Sender
from ringtrain_trainer.ring.transport import LinkError, LinkTimeout, Transport

if TYPE_CHECKING:
    from ringtrain_trainer.ring.watchdog import Watchdog

_FLOAT = np.dtype(np.float32)
_HALF = np.dtype(np.float16)
_BARRIER_TAG = -1
#: How long a broken link waits for the peer's own Abort, which names the root cause (the peer
#: may have closed the link because *its* neighbour died) before blaming that peer.
ABORT_WAIT_S = 0.3


def ring_error(exc: LinkError | str, *, rank: int, step: int, peer: str, what: str) -> RingError:
    """A RingError (PeerTimeout for timeouts) whose message and attributes carry rank, step and
    peer, the three things an operator needs to find the broken link."""
    cls = PeerTimeout if isinstance(exc, LinkTimeout) else RingError
    return cls(f"{what}: {exc}", rank=rank, step=step, peer=peer)


class RingCollective(Collective):
    """Mean allreduce and broadcast over a ring of ``size`` processes ordered by rank."""

    def __init__(
        self,
        transport: Transport,
        rank: int,
        addresses: tuple[str, ...],
        *,
        chunk_bytes: int = schedule.DEFAULT_CHUNK_BYTES,
        step_timeout_s: float = options.DEFAULTS["ring_step_timeout_s"],
        min_bytes_per_s: float = options.DEFAULTS["ring_min_bytes_per_s"],
        control=None,
    ) -> None:
        if chunk_bytes < _FLOAT.itemsize:
            raise ValueError(f"chunk_bytes must be >= {_FLOAT.itemsize}, got {chunk_bytes}")
        self.rank, self.size = rank, len(addresses)
        self.transport = transport
        self._addresses = addresses
        self._chunk = chunk_bytes // _FLOAT.itemsize
        #: bytes per element of the collective in flight (float16 allreduces: 2)
        self._itemsize = _FLOAT.itemsize
        self._step_timeout_s = step_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self._seq = 0
        self._broken: RingError | None = None
        self._sender = Sender(transport)
        self._inline = False  # this collective still writes from the calling thread
        self._closed = False
        self.observer = RingObserver()
        self._sent = self._received = 0
        #: the collective in flight and since when (monotonic), read by the watchdog
        self.position: tuple[OpHeader, float] | None = None
        self.control = control  # a ring.control.ControlPlane, or None (tests' bare rings)
        self.watchdog: Watchdog | None = None
        self._interrupted = threading.Event()

    @property
    def started(self) -> int:
        """Collectives begun so far on this rank (the next one's ``seq``)."""
        return self._seq

    @property
    def received(self) -> int:
        """Bytes the collective in flight has received so far, chunk by chunk."""
        return self._received

    def expected_bytes(self, header: OpHeader) -> int:
        """Bytes this rank receives in the collective of ``header``."""
        if header.kind == Kind.BROADCAST:
            return 0 if self.rank == header.root else header.nelem * _FLOAT.itemsize
        bounds = schedule.segment_bounds(header.nelem, self.size)
        phases = schedule.allreduce_phases(self.rank, self.size)
        size = _HALF.itemsize if header.kind == Kind.ALLREDUCE_F16 else _FLOAT.itemsize
        return sum(bounds[p.recv][1] - bounds[p.recv][0] for p in phases) * size

    def deadline_s(self, header: OpHeader) -> float:
        """The collective's wall-clock budget: the step timeout (a peer may still compute)
        plus its bytes at the floor rate. The step timeout alone restarts on every byte, so a
        peer dripping one byte every few seconds would hold the ring forever (issue 20)."""
        return self._step_timeout_s + self.expected_bytes(header) / self.min_bytes_per_s

    @property
    def broken(self) -> bool:
        return self._broken is not None

    @property
    def refused(self) -> int:
        """Connections and calls refused so far, on the data path and the control plane."""
        own = getattr(self.transport, "refused", 0) or 0
        return own + (self.control.refused if self.control is not None else 0)

    def interrupt(self, err: RingError, kind: str, *, tell_peers: bool) -> None:
        """Break the ring from another thread (a peer's Abort, the watchdog): a collective in
        flight fails at once with ``err``, and so does every later one."""
        if self._broken is not None:
            return
        self._broken = err
        self._interrupted.set()
        self.observer.error(kind)
        if tell_peers:
            self._tell_peers(str(err), isinstance(err, PeerTimeout))
        self.transport.abort()

    def fail(self, reason: str, exit_code: int = 1) -> None:
        """This worker is leaving because of a failure outside the ring (an exception in the
        step loop): tell the peers so that they leave at once too."""
        self._tell_peers(reason)

    def _tell_peers(self, reason: str, timeout: bool = False) -> None:
        if self.control is not None:
            self.control.tell_peers(reason, timeout)

    @property
    def left_peer(self) -> str:
        return self._addresses[schedule.left(self.rank, self.size)]

    @property
    def right_peer(self) -> str:
        return self._addresses[schedule.right(self.rank, self.size)]

    # -- public collectives -------------------------------------------------------------------

    def allreduce_mean_(self, buf: np.ndarray, step: int = 0, tag: int = 0) -> None:
        flat = self._flat(buf, "allreduce_mean_", half_ok=True)
        kind = Kind.ALLREDUCE_F16 if flat.dtype == _HALF else Kind.ALLREDUCE
        header = self._next(kind, step, tag, flat.size)
        self._guarded(
            header,
            lambda finish: self._allreduce(flat, header, finish),
            "barrier" if tag == _BARRIER_TAG and step == -1 else "allreduce",
        )

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast_: root {root} outside ring of size {self.size}")
        flat = self._flat(buf, "broadcast_")
        header = self._next(Kind.BROADCAST, -1, 0, flat.size, root)
        self._guarded(header, lambda finish: self._broadcast(flat, header, finish), "broadcast")

    def barrier(self) -> None:
        """An allreduce of one element per rank: nobody can finish it before everyone started."""
        self.allreduce_mean_(np.zeros(self.size, np.float32), step=-1, tag=_BARRIER_TAG)

    def close(self) -> None:
        """Idempotent; safe from another thread while a collective is blocked (it then fails
        at once instead of waiting for its timeout)."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        self.transport.abort()
        self._sender.stop()
        self.transport.close()
        if self.control is not None:
            self.control.close()

    # -- machinery ----------------------------------------------------------------------------

    def _flat(self, buf: np.ndarray, what: str, half_ok: bool = False) -> np.ndarray:
        if not isinstance(buf, np.ndarray) or not (
            buf.dtype == _FLOAT or (half_ok and buf.dtype == _HALF)
        ):
            raise TypeError(
                f"{what}: needs a float32{' or float16' if half_ok else ''} numpy array, got "
                f"{getattr(buf, 'dtype', type(buf).__name__)}"
            )
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError(f"{what}: buffer must be C-contiguous and writeable (in place)")
        self._itemsize = buf.dtype.itemsize
        return buf.reshape(-1)

    def _next(self, kind: Kind, step: int, tag: int, nelem: int, root: int = 0) -> OpHeader:
        if self._closed:
            raise ring_error(
                "ring closed",
                rank=self.rank,
                step=step,
                peer=self.right_peer,
                what="collective after close()",
            )
        if self._broken is not None:
            raise self._broken
        header = OpHeader(kind, self._seq, step, tag, nelem, root)
        self._seq += 1
        return header

    def _guarded(self, header: OpHeader, body, kind: str) -> None:
        """Run one collective's receive side; ``body`` queues the send thread's end marker
        before its final wait, because a gRPC peer only ends its stream when we end ours.
        The observer hears of it once it is complete, sends included."""
        if self.size == 1:
            return
        self.position = (header, time.monotonic())
        try:
            self._run(header, body, kind)
        finally:
            self.position = None

    def _run(self, header: OpHeader, body, kind: str) -> None:
        start = time.perf_counter()
        self._sent = self._received = 0
        self._inline = True  # the send thread is idle: every earlier collective waited for it
        done = threading.Event()
        queued: list[bool] = []

        def finish_sends() -> None:
            if not queued:
                queued.append(True)
                if self._inline:  # everything went out from this thread
                    done.set()
                else:
                    self._sender.put(done)

        try:
            body(finish_sends)
        except LinkError as e:
            if self._sender.error is not None:  # the send side failed first and aborted us
                self._break(self._sender.error, header, self.right_peer, "sending")
            if e.send_side:
                self._break(e, header, self.right_peer, "sending")
            self._break(e, header, self.left_peer, "receiving")
        except BaseException as e:  # interrupted half-way: the ranks no longer agree on state
            if self._broken is None:
                self._broken = ring_error(
                    f"{type(e).__name__}: {e}",
                    rank=self.rank,
                    step=header.step,
                    peer=self.left_peer,
                    what=f"interrupted {header.describe()}",
                )
                self.transport.abort()
                self.observer.error("interrupted")
                self._tell_peers(str(self._broken))
            raise
        finally:
            finish_sends()
        t0 = time.perf_counter_ns()
        if not done.wait(self._step_timeout_s + 5):
            self._break(LinkTimeout("send thread stuck"), header, self.right_peer, "sending")
        t1 = time.perf_counter_ns()
        if self.peer_waits is not None:  # the right neighbour still taking our bytes
            self.peer_waits.append((t0 * 1e-9, t1 * 1e-9))
        self.tracer.add(
            trace.ALLREDUCE, "wait for rank", t0, schedule.right(self.rank, self.size), t1=t1
        )
        if self._sender.error is not None:
            self._break(self._sender.error, header, self.right_peer, "sending")
        self.observer.collective(kind, time.perf_counter() - start, self._sent, self._received)

    def _break(self, exc: LinkError, header: OpHeader, peer: str, what: str) -> None:
        if self._broken is None and self.control is not None and not isinstance(exc, LinkTimeout):
            self._interrupted.wait(ABORT_WAIT_S)
        if self._broken is None:
            err = ring_error(
                exc, rank=self.rank, step=header.step, peer=peer, what=f"{what} {header.describe()}"
            )
            self._broken = err
            # the Aborts first: a peer whose socket to us breaks next waits for one briefly
            # (ABORT_WAIT_S) and should find it, so that it names the cause, not us
            self._tell_peers(str(err), isinstance(err, PeerTimeout))
            self.transport.abort()
            self.observer.error("timeout" if isinstance(err, PeerTimeout) else "link")
        raise self._broken

    def _send(self, mv: memoryview, a: int, b: int, header: OpHeader | None = None) -> None:
        n = self._itemsize
        self._sent += (b - a) * n
        self._emit(header, mv[a * n : b * n])

    def _emit(self, header: OpHeader | None, data: memoryview | None) -> None:
        """Send the collective's ``header`` and/or a chunk, in order: from this thread while
        the transport takes them whole without blocking, else (and from then on in this
        collective, to keep the byte order) through the send thread."""
        if self._inline:
            parts = [memoryview(header.pack())] if header is not None else []
            if data is not None:
                parts.append(data)
            sent = self.transport.send_now(parts, header is not None)
            if sent is not None:
                for part in parts:
                    if sent < len(part):
                        self._inline = False
                        self._sender.put(part[sent:])
                    sent = max(0, sent - len(part))
                return
            self._inline = False
        if header is not None:
            self._sender.put(header)
        if data is not None:
            self._sender.put(data)

    def _allreduce(self, flat: np.ndarray, header: OpHeader, finish_sends) -> None:
        bounds = schedule.segment_bounds(flat.size, self.size)
        phases = schedule.allreduce_phases(self.rank, self.size)
        mv = memoryview(flat).cast("B")  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__
        t, tr, left = self.transport, self.tracer, schedule.left(self.rank, self.size)
        first = schedule.chunks(*bounds[phases[0].send], self._chunk)
        if not first:
            self._emit(header, None)
        for i, (a, b) in enumerate(first):
            self._send(mv, a, b, header if i == 0 else None)
        waits = self.peer_waits
        clock = time.perf_counter_ns  # one pair of readings for peer_waits and the trace
        t0 = clock()
        t.begin_recv(header)
        t1 = clock()
        if waits is not None:
            waits.append((t0 * 1e-9, t1 * 1e-9))
        tr.add(trace.ALLREDUCE, "wait for rank", t0, left, t1=t1)
        last_reduce = self.size - 2
        for p, phase in enumerate(phases):
            forward = p + 1 < len(phases)
            t_phase = tr.now()
            for a, b in schedule.chunks(*bounds[phase.recv], self._chunk):
                seg = flat[a:b]
                t0 = clock()  # a receive blocks until the left neighbour's chunk is here
                # a partial sum that only passes through goes on without landing here first
                fused = phase.reduce and p < last_reduce and self._inline and t.recv_add_send(seg)
                if fused:
                    self._sent += seg.nbytes
                elif phase.reduce:
                    t.recv_add(seg)
                else:
                    t.recv_copy(seg)
                self._received += seg.nbytes
                t1 = clock()
                if waits is not None:
                    waits.append((t0 * 1e-9, t1 * 1e-9))
                tr.add(trace.ALLREDUCE, "wait for rank", t0, left, t1=t1)
                if phase.reduce and p == last_reduce:
                    np.divide(seg, self.size, out=seg)
                if forward and not fused:
                    self._send(mv, a, b)
            tr.add(
                trace.ALLREDUCE, "reduce-scatter" if phase.reduce else "allgather", t_phase, value=p
            )
        finish_sends()
        t.end_recv()

    def _broadcast(self, flat: np.ndarray, header: OpHeader, finish_sends) -> None:
        mv = memoryview(flat).cast("B")  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__
        sends = schedule.right(self.rank, self.size) != header.root
        pieces = schedule.chunks(0, flat.size, self._chunk)
        if self.rank == header.root:
            if not pieces:
                self._emit(header, None)
            for i, (a, b) in enumerate(pieces):
                self._send(mv, a, b, header if i == 0 else None)
            return
        if sends:
            self._emit(header, None)
        t = self.transport
        t.begin_recv(header)
        for a, b in pieces:
            t.recv_copy(flat[a:b])
            self._received += (b - a) * _FLOAT.itemsize
            if sends:
                self._send(mv, a, b)
        finish_sends()
        t.end_recv()
