"""The ``grpc+tcp`` data path: one authenticated raw TCP stream per ring neighbour, bytes
straight into numpy, opened through the gRPC control plane (the precedent is TensorFlow's own
``grpc+verbs`` and ``grpc+mpi`` server protocols: gRPC for control, another wire for tensors).

The side channel listens on the ring port + 1 (``ringtrain.ports.side_channel_port``, ``ring-data``
in the pod) or, where that is taken (several workers on one host), on any free port; either way
its port is announced in the control plane's ``Register`` answer, so peers connect to what was
actually bound.

grpcio hands every message over as a fresh ``bytes`` object, so each chunk is copied and
allocated twice; gloo instead reduces out of reused buffers. This transport does what gloo does
from Python: ``sendall`` from a memoryview of the caller's buffer and ``recv_into`` either the
destination itself (allgather) or one preallocated scratch chunk that ``np.add(..., out=)``
folds into the destination (reduce-scatter). Socket calls release the GIL, so the engine's send
thread and receive thread really run at once.

Every connection must pass the mutual HMAC handshake of ``ring.auth`` first, keyed not by the
job's token but by 32 random bytes the listener makes for this rendezvous and gives out only
through the control plane (``Register``, mutual TLS where the job has its material); anything
else (a port scanner, a worker of another job, a recorded handshake, a key of an earlier
rendezvous, a second "left neighbour") is answered with a refusal and closed by the listener
thread without touching the ring.

With ``encryptData`` (``--ring-encrypt-data``) both sockets are first wrapped in Python's
``ssl`` with the job's mutual TLS (``ring.tls.ssl_context``): a peer without a certificate of the
job's CA fails before the HMAC handshake, which then runs inside TLS. Its cost is measured in
docs/ring.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from typing import Self

import numpy as np

from ringtrain.cluster import bind_host, split_address
from ringtrain.errors import PeerTimeout
from ringtrain.ports import side_channel_port
from ringtrain_trainer.ring import auth, schedule, tls
from ringtrain_trainer.ring.links import Listener, connect_with_backoff
from ringtrain_trainer.ring.protocol import HEADER_BYTES, OpHeader
from ringtrain_trainer.ring.transport import LinkError, LinkTimeout, Transport


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    try:
        auth.recv_into_exactly(sock, view, "connection closed by peer")
    except auth.PeerClosed as e:
        raise LinkError(str(e)) from None
    except TimeoutError:
        raise LinkTimeout(f"no data for {sock.gettimeout():g} s") from None
    except OSError as e:
        raise LinkError(f"{type(e).__name__}: {e}") from None


def _raw_fd(sock: socket.socket) -> int | None:
    """The descriptor that ``os.readv``/``os.writev`` may use: a plain socket's (a TLS socket's
    carries ciphertext), non-blocking underneath (as a timeout makes it), so no call there
    can wait."""
    if isinstance(sock, ssl.SSLSocket) or os.get_blocking(sock.fileno()):
        return None
    return sock.fileno()


class TcpTransport(Transport):
    """Two authenticated sockets: ``right`` carries our bytes out, ``left`` brings bytes in."""

    name = "grpc+tcp"

    def __init__(
        self, listener: Listener, right: socket.socket, left: socket.socket, step_timeout_s: float
    ) -> None:
        self.listener, self._right, self._left = listener, right, left
        for s in (right, left):
            s.settimeout(step_timeout_s)
        self._right_fd, self._left_fd = _raw_fd(right), _raw_fd(left)
        self._header = memoryview(bytearray(HEADER_BYTES))
        self._expect: OpHeader | None = None  # announced, not read yet (see begin_recv)
        #: per dtype (float32, float16 allreduces), grown to the largest chunk once
        self._scratch: dict = {}
        self._closed = False

    @staticmethod
    def listen(
        rank: int, addresses: tuple[str, ...], material: tls.Material | None = None
    ) -> Listener:
        """The side channel's listener, with a fresh key, on :func:`side_channel_port` of the
        ring port, else on any free port; ``material`` encrypts what it accepts."""
        world = len(addresses)
        _, port = split_address(addresses[rank])
        return Listener(
            side_channel_port(port),
            world,
            schedule.neighbours(rank, world)[0],
            bind_host(addresses),
            fallback=True,
            material=material,
        )

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
    ) -> Self:
        """Connect to the right neighbour's side channel (its port and key from the
        rendezvous) and wait for the left neighbour's; the listener is closed on failure."""
        world = len(addresses)
        left_rank, right_rank = schedule.neighbours(rank, world)
        host, _ = split_address(addresses[right_rank])
        start = time.monotonic()
        try:
            right = connect_with_backoff(
                f"{host}:{right_data_port}", right_key, rank, world, connect_timeout_s, material
            )
        except BaseException:
            listener.close()
            raise
        left = listener.wait_left(max(0.0, connect_timeout_s - (time.monotonic() - start)))
        if left is None:
            right.close()
            listener.close()
            raise PeerTimeout(
                f"left neighbour did not connect within {connect_timeout_s:g} s",
                rank=rank,
                step=-1,
                peer=addresses[left_rank],
            )
        return cls(listener, right, left, step_timeout_s)

    @property
    def refused(self) -> int:
        """Connections refused so far (failed handshake, wrong rank, duplicate)."""
        return self.listener.refused

    def begin_send(self, header: OpHeader) -> None:
        self.send(memoryview(header.pack()))

    def send(self, data: memoryview) -> None:
        try:
            self._right.sendall(data)
        except TimeoutError:
            raise LinkTimeout(f"peer accepted no data for {self._right.gettimeout():g} s") from None
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}") from None

    def send_now(self, parts: list[memoryview], with_header: bool = False) -> int | None:
        """One ``writev`` of header and chunk on the non-blocking descriptor: no poll first
        (which ``socket.send`` does under a timeout) and nothing waits for buffer space."""
        if self._right_fd is None:
            return None
        try:
            return os.writev(self._right_fd, parts)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise LinkError(f"{type(e).__name__}: {e}", send_side=True) from None

    def begin_recv(self, header: OpHeader) -> None:
        """On a plain socket the header is only expected here and read in one ``readv`` with
        the first chunk that lands in scratch (``recv_add``), or alone before one that lands in
        the caller's buffer, which is thus never touched by a collective it did not ask for."""
        self._expect = header
        if self._left_fd is None:
            self._take_header()

    def _take_header(self, *then: memoryview) -> None:
        self._recv([self._header, *then])
        expected, self._expect = self._expect, None
        assert expected is not None  # callers check that a header was announced
        got = OpHeader.unpack(bytes(self._header))
        if got is None:
            raise LinkError("peer sent a malformed collective header")
        if got.mismatch(expected) is not None:
            raise LinkError(f"peer is at {got.describe()}, this rank at {expected.describe()}")

    def _recv(self, views: list[memoryview]) -> None:
        """Fill ``views`` in order: one non-blocking ``readv`` first (in step with the peer the
        bytes are often all here: one call, no poll), blocking receives under the step
        timeout for whatever is still missing."""
        if self._left_fd is not None:
            try:
                got = os.readv(self._left_fd, views)
                if got == 0:
                    raise LinkError("connection closed by peer")
            except BlockingIOError:
                got = 0
            except OSError as e:
                raise LinkError(f"{type(e).__name__}: {e}") from None
            for i, view in enumerate(views):
                if got < len(view):
                    views = [view[got:], *views[i + 1 :]]
                    break
                got -= len(view)
            else:
                return
        for view in views:
            _recv_into(self._left, view)

    def recv_copy(self, out: np.ndarray) -> None:
        if self._expect is not None:
            self._take_header()
        self._recv([memoryview(out).cast("B")])  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__

    def recv_add(self, out: np.ndarray) -> None:
        scratch = self._scratch.get(out.dtype)
        if scratch is None or scratch.size < out.size:
            scratch = self._scratch[out.dtype] = np.empty(out.size, out.dtype)
        tmp = scratch[: out.size]
        if self._expect is not None:
            self._take_header(memoryview(tmp).cast("B"))  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__
        else:
            self._recv([memoryview(tmp).cast("B")])  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__
        np.add(out, tmp, out=out)

    def end_recv(self) -> None:
        if self._expect is not None:  # a collective with nothing for this rank to receive
            self._take_header()

    def abort(self) -> None:
        for s in (self._right, self._left):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.abort()
        self._right.close()
        self._left.close()
        self.listener.close()
