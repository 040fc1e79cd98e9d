"""The all-gRPC transport: one client stream per collective to the right neighbour.

Each rank serves ``ringtrain.Ring`` on its TF_CONFIG port, in the same gRPC server as the
control plane (``ring.control``), with two raw-bytes methods (no protobuf: messages are the
tensor bytes themselves):

- ``Hello`` (unary) at start-up: the ring's rendezvous; proves the token and the caller's rank.
- ``Push`` (client streaming): one call per collective, its header in the metadata, one
  message per chunk. The handler refuses before reading a single message: no or wrong token →
  UNAUTHENTICATED; a caller that is not the left neighbour → PERMISSION_DENIED; another
  collective position or step/bucket → FAILED_PRECONDITION; another size → INVALID_ARGUMENT.
  Accepted chunks go to the receiver through a queue and are reduced straight out of gRPC's
  ``bytes`` (``np.frombuffer``), so the only copies are the ones grpcio itself makes.

Slower than ``grpc+tcp`` (grpcio copies every message), but it needs nothing but gRPC and serves as
the reference path.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import NoReturn

import grpc
import numpy as np

from ringtrain.errors import InvalidSpec, PeerTimeout, Unauthenticated
from ringtrain_trainer.ring import auth, channels, schedule, tls
from ringtrain_trainer.ring.auth import OP_KEY, call_metadata
from ringtrain_trainer.ring.protocol import Mismatch, OpHeader
from ringtrain_trainer.ring.transport import LinkError, LinkTimeout, Transport

SERVICE = "ringtrain.Ring"
_HELLO = f"/{SERVICE}/Hello"
_PUSH = f"/{SERVICE}/Push"
_END = object()

CHANNEL_OPTIONS = channels.OPTIONS

_MISMATCH_STATUS = {
    Mismatch.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Mismatch.SEQUENCE: grpc.StatusCode.FAILED_PRECONDITION,
    Mismatch.STEP: grpc.StatusCode.FAILED_PRECONDITION,
    Mismatch.SIZE: grpc.StatusCode.INVALID_ARGUMENT,
}


class _Receiver:
    """Server side: checks every call and hands accepted chunks to the receive thread."""

    def __init__(
        self,
        token: bytes,
        rank: int,
        world: int,
        step_timeout_s: float,
        material: tls.Material | None = None,
    ) -> None:
        self._token, self._rank, self._world = token, rank, world
        self._tls = material
        self._left, _ = schedule.neighbours(rank, world)
        self._timeout = step_timeout_s
        self._cond = threading.Condition()
        self._current: OpHeader | None = None
        self._taken = False
        self._closed = False
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.hello = threading.Event()
        self.refused = 0
        self._active: set = set()

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, text: str) -> NoReturn:
        with self._cond:
            self.refused += 1
        context.abort(code, f"rank {self._rank}: {text}")

    def _authorise(self, context: grpc.ServicerContext) -> dict:
        md, why = auth.refusal(
            context,
            self._tls,
            self._token,
            self._world,
            (str(self._left),),
            f"the left neighbour {self._left}",
        )
        if why is not None:
            self._refuse(context, *why)
        return md

    def hello_rpc(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorise(context)
        self.hello.set()
        return b""

    def push_rpc(self, request_iterator, context: grpc.ServicerContext) -> bytes:
        md = self._authorise(context)
        got = OpHeader.unpack(md.get(OP_KEY, b""))
        if got is None:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed collective header")
        with self._cond:
            ready = self._cond.wait_for(
                lambda: (
                    self._closed or (self._current is not None and self._current.seq >= got.seq)
                ),
                self._timeout,
            )
            current, taken = self._current, self._taken
            why = None
            if self._closed:
                why = (grpc.StatusCode.UNAVAILABLE, "ring closed")
            elif not ready:
                why = (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"not at {got.describe()} within {self._timeout:g} s",
                )
            elif current is None:  # cannot happen: the wait returned true only once it was set
                why = (grpc.StatusCode.INTERNAL, "no collective announced")
            elif taken and current.seq == got.seq:
                why = (grpc.StatusCode.FAILED_PRECONDITION, f"{got.describe()} already received")
            else:
                mismatch = got.mismatch(current)
                if mismatch is not None:
                    why = (
                        _MISMATCH_STATUS[mismatch],
                        f"caller is at {got.describe()}, this rank at {current.describe()}",
                    )
            if why is None:
                self._taken = True
                inbox = self.inbox
                self._active.add(context)
        if why is not None:
            self._refuse(context, *why)
        try:
            for message in request_iterator:
                inbox.put(message)
        finally:
            inbox.put(_END)
            with self._cond:
                self._active.discard(context)
        return b""

    def expect(self, header: OpHeader) -> None:
        with self._cond:
            self._current, self._taken = header, False
            self.inbox = queue.SimpleQueue()
            self._cond.notify_all()

    def close(self, reason: LinkError | None = None) -> None:
        """Stop receiving: wake the receive thread (with ``reason`` when the send side failed)
        and cancel the left neighbour's open call, so that it fails at once as well."""
        with self._cond:
            self._closed = True
            self.inbox.put(reason if reason is not None else _END)
            active, self._active = list(self._active), set()
            self._cond.notify_all()
        for context in active:
            context.cancel()


def _rpc_failure(e: BaseException, what: str, *, send_side: bool = False) -> LinkError:
    code = e.code() if hasattr(e, "code") else None
    cls = LinkTimeout if code == grpc.StatusCode.DEADLINE_EXCEEDED else LinkError
    return cls(
        f"{what}: {getattr(code, 'name', code)}: {e.details() if hasattr(e, 'details') else e}",
        send_side=send_side,
    )


class GrpcTransport(Transport):
    """Handlers in this worker's gRPC server for the left link and a channel to the right
    neighbour's server; the server itself belongs to the control plane."""

    name = "grpc"

    def __init__(
        self,
        receiver: _Receiver,
        channel: grpc.Channel,
        token: bytes,
        rank: int,
        world: int,
        step_timeout_s: float,
    ) -> None:
        self._receiver, self._channel = receiver, channel
        self._push = channel.stream_unary(
            _PUSH, request_serializer=None, response_deserializer=None
        )
        self._token, self._rank, self._world = token, rank, world
        self._timeout = step_timeout_s
        self._outbox: queue.SimpleQueue | None = None
        self._call: grpc.Future | None = None
        self._ending = False
        self._inbox: queue.SimpleQueue | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def refused(self) -> int:
        """Calls refused so far by this rank's server."""
        return self._receiver.refused

    @staticmethod
    def receiver(
        rank: int,
        world: int,
        token: bytes,
        step_timeout_s: float,
        material: tls.Material | None = None,
    ) -> tuple[_Receiver, grpc.GenericRpcHandler]:
        """The server side, to be added to the worker's gRPC server before it starts."""
        receiver = _Receiver(token, rank, world, step_timeout_s, material)
        return receiver, grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Hello": grpc.unary_unary_rpc_method_handler(receiver.hello_rpc),
                "Push": grpc.stream_unary_rpc_method_handler(receiver.push_rpc),
            },
        )

    @classmethod
    def open(
        cls,
        receiver: _Receiver,
        rank: int,
        addresses: tuple[str, ...],
        token: bytes,
        *,
        connect_timeout_s: float,
        step_timeout_s: float,
        material: tls.Material | None = None,
    ) -> GrpcTransport:
        world = len(addresses)
        left_rank, right_rank = schedule.neighbours(rank, world)
        right = addresses[right_rank]
        channel = channels.channel(right, material)
        try:
            start = time.monotonic()
            cls._hello(channel, token, rank, world, right, connect_timeout_s)
            left_wait = max(0.0, connect_timeout_s - (time.monotonic() - start))
            if not receiver.hello.wait(left_wait):
                raise PeerTimeout(
                    f"left neighbour did not say hello within {connect_timeout_s:g} s",
                    rank=rank,
                    step=-1,
                    peer=addresses[left_rank],
                )
        except BaseException:
            channel.close()
            receiver.close()
            raise
        return cls(receiver, channel, token, rank, world, step_timeout_s)

    @staticmethod
    def _hello(
        channel: grpc.Channel, token: bytes, rank: int, world: int, peer: str, timeout_s: float
    ) -> None:
        """Rendezvous with the right neighbour, retrying while it is not serving yet."""
        hello = channel.unary_unary(_HELLO, request_serializer=None, response_deserializer=None)
        deadline, delay = time.monotonic() + timeout_s, 0.02
        while True:
            remaining = deadline - time.monotonic()
            try:
                hello(
                    b"",
                    metadata=call_metadata(token, rank, world),
                    timeout=max(0.1, remaining),
                    wait_for_ready=True,
                )
                return
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise Unauthenticated(
                        f"{peer} refused the ring token: {e.details()}", rank=rank
                    ) from None
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                    raise InvalidSpec(
                        f"rank {rank}: {peer} refused: {e.details()} (do all "
                        "workers have the same TF_CONFIG cluster?)"
                    ) from None
                retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if time.monotonic() + delay >= deadline or not retryable:
                    raise PeerTimeout(
                        f"no hello within {timeout_s:g} s ({code.name}: {e.details()})",
                        rank=rank,
                        step=-1,
                        peer=peer,
                    ) from None
            time.sleep(delay)  # backoff between attempts (wait_for_ready covers most waiting)
            delay = min(delay * 2, 1.0)

    # -- send side (send thread) --------------------------------------------------------------

    def begin_send(self, header: OpHeader) -> None:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._closed:
                raise LinkError("transport closed")
            self._outbox = outbox
            self._call = self._push.future(
                iter(outbox.get, _END),
                metadata=call_metadata(self._token, self._rank, self._world, header),
            )
            self._ending = False
        assert self._call is not None  # set above
        self._call.add_done_callback(self._call_done)

    def _call_done(self, call: grpc.Future) -> None:
        """A Push call ended. Ending before we closed its stream means the right neighbour
        refused or vanished: abort now rather than when the send thread next looks, because
        the receive thread may be waiting for data that can no longer come."""
        if self._ending or call.cancelled():
            return
        error = call.exception()
        if error is not None:
            self.abort(_rpc_failure(error, "right neighbour refused or lost", send_side=True))

    def send(self, data: memoryview) -> None:
        outbox = self._outbox
        if outbox is None:
            raise LinkError("send without begin_send: no Push call is open")
        outbox.put(data.tobytes())

    def end_send(self) -> None:
        """Close the open Push call's stream and wait for the right neighbour to accept it.
        The call is forgotten first, so a later ``end_send`` or ``send`` cannot reuse a
        finished call (a collective that sends nothing must not end anything)."""
        with self._lock:
            outbox, call = self._outbox, self._call
            if outbox is None or call is None:
                raise LinkError("end_send without begin_send: no Push call is open")
            self._outbox = None
            self._ending = True
        outbox.put(_END)
        try:
            call.result(timeout=self._timeout)
        except grpc.FutureTimeoutError:
            call.cancel()
            raise LinkTimeout(
                f"right neighbour did not take the collective within {self._timeout:g} s"
            ) from None
        except grpc.FutureCancelledError:
            raise LinkError("collective cancelled (ring aborted)") from None
        except grpc.RpcError as e:
            raise _rpc_failure(e, "right neighbour refused or lost") from None

    # -- receive side (communication thread) --------------------------------------------------

    def begin_recv(self, header: OpHeader) -> None:
        self._receiver.expect(header)
        self._inbox = self._receiver.inbox

    def _next(self, nbytes: int) -> bytes:
        try:
            assert self._inbox is not None  # set by begin_recv
            msg = self._inbox.get(timeout=self._timeout)
        except queue.Empty:
            raise LinkTimeout(f"no data for {self._timeout:g} s") from None
        if isinstance(msg, LinkError):
            raise msg
        if msg is _END:
            raise LinkError("left neighbour's stream ended early")
        if len(msg) != nbytes:
            raise LinkError(f"chunk of {len(msg)} bytes where {nbytes} were due")
        return msg

    def recv_copy(self, out: np.ndarray) -> None:
        out[...] = np.frombuffer(self._next(out.nbytes), out.dtype)

    def recv_add(self, out: np.ndarray) -> None:
        np.add(out, np.frombuffer(self._next(out.nbytes), out.dtype), out=out)

    def end_recv(self) -> None:
        """Wait for the stream's end marker so a late message can never spill into the next
        collective's queue."""
        try:
            assert self._inbox is not None  # set by begin_recv
            msg = self._inbox.get(timeout=self._timeout)
        except queue.Empty:
            raise LinkTimeout(
                f"left neighbour's stream did not end within {self._timeout:g} s"
            ) from None
        if isinstance(msg, LinkError):
            raise msg
        if msg is not _END:
            raise LinkError("left neighbour sent more chunks than the collective has")

    def abort(self, reason: LinkError | None = None) -> None:
        self._receiver.close(reason)
        with self._lock:
            self._closed = True
            if self._outbox is not None:
                self._outbox.put(_END)
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        self.abort()
        self._channel.close()
