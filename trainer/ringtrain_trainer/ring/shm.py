"""Shared memory between ring neighbours on the same host: the ``grpc+tcp`` side channel still
opens, authenticates and signals every link, but a chunk's bytes go through a few slots of
memory the two processes share instead of through the kernel's TCP stack (NCCL's SHM
transport, Open MPI's shared-memory BTL: the far mark ``bench allreduce --baseline mpi`` sets).

Why: on one host a TCP chunk is copied twice by the kernel (into the socket, out of it) and
reduced from a scratch copy; through a slot it is copied once by the sender and reduced or
copied straight out of the slot by the receiver (measured in docs/ring.md). Only one signal
byte per chunk crosses the socket each way: "slot filled" from the sender after its copy,
"slot free" back from the receiver after its read. The socket's own ordering is the memory
barrier, and its closing, timeouts and aborts keep working exactly as on the TCP path, so a
broken or frozen neighbour is seen the same way.

A link turns to shared memory only if the receiver's segment is provably reachable: after the
HMAC handshake each receiver offers its left neighbour a ``memfd`` (pid, descriptor, a random
name and nonce); the sender opens it through ``/proc/<pid>/fd`` only if that link names the
offered memfd, maps it, and accepts only if the nonce is in it. Workers in separate pods
(separate PID namespaces), or with ``ring.sharedMemory`` off or ``encryptData`` on, fail or skip
that check and keep the TCP path; the transport's name (metric label, log line) says which runs.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Self

import numpy as np

from ringtrain.errors import RingError
from ringtrain_trainer.ring import schedule, tls
from ringtrain_trainer.ring.links import Listener
from ringtrain_trainer.ring.protocol import OpHeader
from ringtrain_trainer.ring.schedule import DEFAULT_CHUNK_BYTES
from ringtrain_trainer.ring.shm_segment import MAX_SLOTS, Segment, attach, create, plan
from ringtrain_trainer.ring.tcp import TcpTransport, _recv_into
from ringtrain_trainer.ring.transport import LinkError, LinkTimeout

_OFFER = struct.Struct("!4sBIi16sIQ")  # magic, on, pid, fd, nonce, slots, slot bytes
_MAGIC = b"RTSM"


def _as(slot: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A slot's (bytes) first ``out.nbytes`` as ``out``'s dtype: float32, or float16 for an
    allreduce of float16 gradients."""
    return slot[: out.nbytes].view(out.dtype)


def _read(sock: socket.socket, n: int, side: str) -> bytes:
    buf = bytearray(n)
    try:
        _recv_into(sock, memoryview(buf))
    except LinkError as e:
        raise LinkError(f"{side} neighbour: {e}", send_side=side == "right") from None
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, side: str) -> None:
    try:
        sock.sendall(data)
    except OSError as e:
        raise LinkError(
            f"{side} neighbour: {type(e).__name__}: {e}", send_side=side == "right"
        ) from None


def negotiate(
    left: socket.socket, right: socket.socket, chunk_bytes: int, enabled: bool
) -> tuple[Segment | None, Segment | None]:
    """(segment we receive from the left in, segment we send to the right through): offer the
    left neighbour our own segment, try the right neighbour's offer, then learn the left's
    verdict. Every rank writes before it reads, so the ring cannot deadlock on it."""
    slots, slot_bytes = plan(chunk_bytes)
    mine = fd = None
    nonce = bytes(16)
    if enabled:
        try:
            mine, fd, nonce = create(slots, slot_bytes)
        except OSError:
            mine = None
    try:
        _send(
            left,
            _OFFER.pack(
                _MAGIC,
                mine is not None,
                os.getpid(),
                fd if fd is not None else -1,
                nonce,
                slots,
                slot_bytes,
            ),
            "left",
        )
        magic, on, pid, their_fd, their_nonce, n, size = _OFFER.unpack(
            _read(right, _OFFER.size, "right")
        )
        if magic != _MAGIC:
            raise LinkError("right neighbour sent no shared-memory offer", send_side=True)
        theirs = (
            attach(pid, their_fd, their_nonce, n, size)
            if enabled and on and (n, size) == (slots, slot_bytes)
            else None
        )
        _send(right, b"\x01" if theirs is not None else b"\x00", "right")
        accepted = _read(left, 1, "left") == b"\x01"
    finally:
        if fd is not None:
            os.close(fd)  # the mappings stay; the memfd is freed with the last of them
    return (mine if accepted else None), theirs


class ShmTransport(TcpTransport):
    """``TcpTransport`` whose links to same-host neighbours carry chunks through shared slots.

    Sender: slot ``k % slots`` holds the ``k``-th chunk of this link; a chunk goes out when a
    slot is free (fewer than ``slots`` unanswered), else the engine's send thread waits for a
    "free" byte. Receiver: one "filled" byte (the slot number) per chunk, then the reduction
    or copy reads the slot in place; consumed slots go back as one byte carrying their count
    (see ``_free``). A link without shared memory runs ``TcpTransport``'s code unchanged."""

    def __init__(
        self, listener: Listener, right: socket.socket, left: socket.socket, step_timeout_s: float
    ) -> None:
        super().__init__(listener, right, left, step_timeout_s)
        self._in: Segment | None = None
        self._out: Segment | None = None
        self._filled = self._freed = self._taken = self._unreported = 0
        self._report_at = 1
        self._signal = bytearray(1)
        self._frees = bytearray(4 * MAX_SLOTS)

    @classmethod
    def open(
        cls,
        listener: Listener,
        rank: int,
        addresses: tuple[str, ...],
        right_data_port: int,
        right_key: bytes,
        *,
        connect_timeout_s: float,
        step_timeout_s: float,
        material: tls.Material | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        shared_memory: bool = True,
    ) -> Self:
        """``TcpTransport.open``, then the shared-memory offer on both links; a link that
        breaks meanwhile is a (retryable) RingError naming the neighbour. ``chunk_bytes`` and
        ``shared_memory`` default as in ``ring.connect``."""
        t = super().open(
            listener,
            rank,
            addresses,
            right_data_port,
            right_key,
            connect_timeout_s=connect_timeout_s,
            step_timeout_s=step_timeout_s,
            material=material,
        )
        try:
            t._in, t._out = negotiate(
                t._left,
                t._right,
                chunk_bytes,
                shared_memory and None not in (t._left_fd, t._right_fd),
            )
        except LinkError as e:
            t.close()
            left, right = schedule.neighbours(rank, len(addresses))
            raise RingError(
                f"shared-memory offer: {e}",
                rank=rank,
                step=-1,
                peer=addresses[right if e.send_side else left],
            ) from None
        if t._in is not None:
            t._report_at = max(1, t._in.slots // 2)
        if t._in is not None or t._out is not None:
            t.name = "grpc+shm" if t._in is not None and t._out is not None else "grpc+tcp+shm"
        return t

    @property
    def links(self) -> tuple[str, str]:
        """How the (left, right) links carry tensors: ``shm`` or ``tcp``."""
        return ("shm" if self._in is not None else "tcp", "shm" if self._out is not None else "tcp")

    # -- send side ---------------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        """Count the receiver's "free" bytes; ``block``: wait for at least one."""
        view = memoryview(self._frees)
        assert self._right_fd is not None  # a shared-memory link is a raw socket (open)
        try:
            got: int | None = os.readv(self._right_fd, [view])
        except BlockingIOError:
            got = None
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}", send_side=True) from None
        if got is None and block:
            try:
                got = self._right.recv_into(view)
            except TimeoutError:
                raise LinkTimeout(
                    f"right neighbour freed no slot for {self._right.gettimeout():g} s",
                    send_side=True,
                ) from None
            except OSError as e:
                raise LinkError(f"{type(e).__name__}: {e}", send_side=True) from None
        if got == 0:
            raise LinkError("connection closed by peer", send_side=True)
        self._freed += sum(self._frees[:got]) if got else 0
        if self._freed > self._filled:
            raise LinkError("right neighbour freed a slot it was never given", send_side=True)

    def _room(self, out: Segment, block: bool) -> bool:
        """Whether the next slot of ``out`` is free, reading "free" bytes as needed
        (``block``: until)."""
        if self._filled - self._freed < out.slots:
            return True
        self._drain(block=False)
        while block and self._filled - self._freed >= out.slots:
            self._drain(block=True)
        return self._filled - self._freed < out.slots

    def _put(self, out: Segment, data: memoryview, block: bool) -> bytes | None:
        """Copy ``data`` into the next slot of ``out``; its "filled" byte, or None if no slot
        is free."""
        if not self._room(out, block):
            return None
        slot = self._filled % out.slots
        np.copyto(out.bytes[slot][: len(data)], np.frombuffer(data, np.uint8))
        self._filled += 1
        return bytes((slot,))

    def _write(self, parts: list[bytes | memoryview]) -> None:
        """Write small signal/header bytes whole: one non-blocking ``writev``, the rest (a full
        socket buffer, rare) blocking under the step timeout."""
        assert self._right_fd is not None  # a shared-memory link is a raw socket (open)
        try:
            sent = os.writev(self._right_fd, parts)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}", send_side=True) from None
        if sent == sum(len(p) for p in parts):
            return
        try:
            TcpTransport.send(self, memoryview(b"".join(bytes(p) for p in parts)[sent:]))
        except LinkError as e:
            raise type(e)(str(e), send_side=True) from None

    def send_now(self, parts: list[memoryview], with_header: bool = False) -> int | None:
        if self._out is None:
            return super().send_now(parts, with_header)
        out: list[bytes | memoryview] = []
        taken = 0
        if with_header:
            out.append(parts[0])
            taken = len(parts[0])
        if len(parts) > int(with_header):
            filled = self._put(self._out, parts[-1], block=False)
            if filled is not None:
                out.append(filled)
                taken += len(parts[-1])
        if out:
            self._write(out)
        return taken

    def begin_send(self, header: OpHeader) -> None:
        if self._out is None:
            return super().begin_send(header)
        self._write([header.pack()])

    def send(self, data: memoryview) -> None:
        if self._out is None:
            return super().send(data)
        filled = self._put(self._out, data, block=True)
        assert filled is not None  # block: waits for a free slot or raises
        self._write([filled])

    # -- receive side ------------------------------------------------------------------------

    def _slot(self, seg: Segment, n: int) -> int:
        """Wait for the next "filled" byte of ``seg`` (with the collective's header if still
        due)."""
        signal = memoryview(self._signal)
        if self._expect is not None:
            self._take_header(signal)
        else:
            self._recv([signal])
        slot = self._taken % seg.slots
        if self._signal[0] != slot or n > seg.slot_bytes:
            raise LinkError(f"peer filled slot {self._signal[0]}, expected {slot}")
        self._taken += 1
        return slot

    def _free(self, flush: bool = False) -> None:
        """Give consumed slots back: one byte carrying their count, once half the slots are
        consumed and at the end of every collective (not per chunk: a write each is a syscall
        the sender rarely needs; it waits only when every slot is unanswered, and then the
        receiver, which never blocks on anything but the next "filled" byte, reaches half)."""
        if not flush:
            self._unreported += 1
            if self._unreported < self._report_at:
                return
        if not self._unreported:
            return
        signal, self._unreported = bytes((self._unreported,)), 0
        assert self._left_fd is not None  # a shared-memory link is a raw socket (open)
        try:
            if os.write(self._left_fd, signal) == 1:
                return
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return  # the sender left (its last collective needs no answer); if it died
            # mid-collective, the next "filled" byte it owes us is what fails
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}") from None
        try:
            self._left.sendall(signal)
        except (BrokenPipeError, ConnectionResetError):
            return
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}") from None

    def recv_add_send(self, out: np.ndarray) -> bool:
        """The sum goes from the left's slot and ``out`` straight into our right slot: one
        pass over memory instead of an add into ``out`` and a copy out of it."""
        if self._in is None or self._out is None or not self._room(self._out, block=False):
            return False
        slot = self._slot(self._in, out.nbytes)
        target = self._filled % self._out.slots
        np.add(out, _as(self._in.bytes[slot], out), out=_as(self._out.bytes[target], out))
        self._free()
        self._filled += 1
        self._write([bytes((target,))])
        return True

    def recv_copy(self, out: np.ndarray) -> None:
        if self._in is None:
            return super().recv_copy(out)
        slot = self._slot(self._in, out.nbytes)
        np.copyto(out, _as(self._in.bytes[slot], out))
        self._free()

    def recv_add(self, out: np.ndarray) -> None:
        if self._in is None:
            return super().recv_add(out)
        slot = self._slot(self._in, out.nbytes)
        np.add(out, _as(self._in.bytes[slot], out), out=out)
        self._free()

    def end_recv(self) -> None:
        super().end_recv()
        if self._in is not None:
            self._free(flush=True)
