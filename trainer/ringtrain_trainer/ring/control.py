"""The ring's control plane: one gRPC server per worker on its ring port (the seeds'
``tf.distribute.Server``), serving ``ringtrain.Control`` and the standard ``grpc.health.v1``
Health service, plus the all-gRPC data path's ``ringtrain.Ring`` when that path runs.

``ringtrain.Control`` (raw bytes, JSON bodies, no protobuf; token, rank and ring size in the
metadata of every call, as the data path's calls carry them):

- ``Register``: the rendezvous. Every worker registers with every peer and waits, with back-off
  and the connect deadline, until all have answered; the answer names the peer's TCP side
  channel (the ``grpc+tcp`` data path), so that port is learnt here and never guessed, and,
  to the one caller allowed to connect there (its left neighbour), that side channel's key.

  Why the listener's own ``Register`` answer carries its key (to its left neighbour only,
  after mutual TLS and the token): see ``ring.auth``.
- ``Abort``: "I am leaving because of this failure": the receiver breaks its collective at once
  (naming the sender) instead of waiting for a socket error or the step timeout.
- ``State``: where a worker is (collectives started, the one in flight), for stall reports.

Peers restart (a killed container, a survivor rejoining by re-exec, ``ringtrain_trainer.rejoin``)
while others are already waiting again, so each process has a random ``incarnation``: the
``Register`` answer carries it, and an ``Abort`` counts only from the incarnation this worker
registered with — a restarting peer's predecessor, still leaving, can neither abort the new
rendezvous nor be registered with (a leaving process refuses ``Register`` as UNAVAILABLE, so the
caller retries until the new process answers).

Health is the one service without the token: kubelet's gRPC probe and ``ringtrain health``
carry none, and it reveals nothing but "serving". With the job's TLS material the whole server
is mutual TLS (``channels``), Health included: ``ringtrain health`` then presents the job's
certificate from ``RINGTRAIN_TLS_DIR``; the kubelet's own gRPC probe cannot (it speaks no TLS),
so ``health_port`` serves the same Health service alone, in plaintext, on a port of its own. A
wrong or missing token on the control service is refused (UNAUTHENTICATED) before any state is
touched.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringtrain.cluster import bind_host
from ringtrain.errors import PeerTimeout, RingError
from ringtrain_trainer.ring import auth, channels, schedule, tls
from ringtrain_trainer.ring.auth import RANK_KEY, call_metadata

SERVICE = "ringtrain.Control"
#: Health service name whose status follows the ring (SERVING once joined, not after a break);
#: the empty name (what probes ask) is SERVING while the process serves at all.
RING_HEALTH = "ringtrain.Ring"
#: Longest a failing worker waits for its Abort calls to be delivered before it exits.
ABORT_GRACE_S = 1.0


def log(msg: str) -> None:
    print(f"ringtrain ring: {msg}", file=sys.stderr, flush=True)


class ControlPlane:
    """This worker's gRPC server and its channels to every peer.

    Life cycle: construct (binds the ring port), :meth:`add_handlers` (the grpc data path),
    :meth:`start`, :meth:`rendezvous`, then the collective :meth:`attach`-es itself, after which
    aborts from peers interrupt it. ``names`` are the ranks' task names (``worker-2``)."""

    def __init__(
        self,
        rank: int,
        addresses: tuple[str, ...],
        names: tuple[str, ...],
        token: bytes,
        port: int,
        material: tls.Material | None = None,
        *,
        health_port: int = 0,
    ) -> None:
        self.rank, self.addresses, self.names = rank, addresses, names
        self.world = len(addresses)
        self._ranks = frozenset(str(r) for r in range(self.world))
        self._token = token
        self.tls = material
        host = bind_host(addresses)
        self._lock = threading.Lock()
        self.refused = 0
        self.server = channels.server(
            port,
            host=host,
            material=material,
            max_connections=channels.connection_limit(self.world),
            interceptors=(auth.TokenGate(token, rank, self._count_refused),),
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server = None
        if health_port:
            try:
                self.health_server = channels.server(
                    health_port,
                    host=host,
                    max_workers=2,
                    max_message_bytes=channels.HEALTH_MAX_MESSAGE_BYTES,
                )
            except channels.BindError:
                self.server.stop(None)
                raise
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Register": grpc.unary_unary_rpc_method_handler(self._register),
                        "Abort": grpc.unary_unary_rpc_method_handler(self._abort),
                        "State": grpc.unary_unary_rpc_method_handler(self._state),
                    },
                ),
            )
        )
        self.data_port: int | None = None  # the TCP side channel's, announced by Register
        self.data_key: bytes | None = None  # its key, told only to the left neighbour
        self.aborted: RingError | None = None  # a peer's Abort that came before attach()
        self._collective = None
        self._channels: dict[int, grpc.Channel] = {}
        self._pending: list[grpc.Future] = []
        self._told = False
        self._closed = False
        self.incarnation = secrets.token_hex(8)
        #: each peer's incarnation, from its Register answer
        self.peer_incarnation: dict[int, str] = {}
        #: the latest abort of each peer from an incarnation not (yet) registered with
        self._unmatched: dict[int, tuple[str, str]] = {}
        #: called once when the ring breaks before a collective is attached (wakes the data
        #: path's wait for its left neighbour)
        self.on_abort: Callable[[], None] | None = None

    def _count_refused(self) -> None:
        with self._lock:
            self.refused += 1

    def name(self, rank: int) -> str:
        return f"{self.names[rank]} ({self.addresses[rank]})"

    def add_handlers(self, handler: grpc.GenericRpcHandler) -> None:
        self.server.add_generic_rpc_handlers((handler,))

    def start(self) -> None:
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(RING_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()

    def channel(self, rank: int) -> grpc.Channel:
        with self._lock:
            if rank not in self._channels:
                self._channels[rank] = channels.channel(self.addresses[rank], self.tls)
            return self._channels[rank]

    # -- server side ----------------------------------------------------------------------------

    def _authorise(self, context: grpc.ServicerContext) -> int:
        md, why = auth.refusal(
            context, self.tls, self._token, self.world, self._ranks, "in the ring"
        )
        if why is not None:
            with self._lock:
                self.refused += 1
            context.abort(why[0], f"rank {self.rank}: {why[1]}")
        return int(md[RANK_KEY])

    def _register(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        caller = self._authorise(context)
        try:
            theirs = json.loads(request or b"{}").get("incarnation")
        except (ValueError, AttributeError):
            theirs = None
        with self._lock:
            known = self.peer_incarnation.get(caller)
        if known is not None and theirs is not None and theirs != known:
            # the process this one registered with is gone and its successor is here: this
            # ring cannot form or go on; leave it, so that both meet in a fresh rendezvous
            self._leave(
                RingError(
                    f"{self.name(caller)} restarted (its new process registered)",
                    rank=self.rank,
                    peer=self.addresses[caller],
                )
            )
        coll = self._collective
        if (
            self._told
            or self._closed
            or self.aborted is not None
            or (coll is not None and coll.broken)
        ):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {self.rank}: leaving the ring")
        doc: dict = {
            "rank": self.rank,
            "data_port": self.data_port,
            "incarnation": self.incarnation,
        }
        if self.data_key is not None and caller == schedule.left(self.rank, self.world):
            doc["data_key"] = self.data_key.hex()
        return json.dumps(doc).encode()

    def _abort(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        sender = self._authorise(context)
        try:
            doc = json.loads(request)
            reason, cls = (
                str(doc["reason"])[:2000],
                (PeerTimeout if doc.get("timeout") else RingError),
            )
            incarnation = str(doc["incarnation"])
        except (ValueError, TypeError, KeyError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed abort")
        with self._lock:
            if incarnation != self.peer_incarnation.get(sender):
                # kept in case that process's Register answer is still on its way to us
                self._unmatched[sender] = (incarnation, reason)
                known = False
            else:
                known = True
        if not known:
            log(
                f"rank {self.rank}: an abort from {self.name(sender)}, not (yet) the process "
                f"this worker registered with ({reason[:200]})"
            )
            return b""
        with self._lock:
            coll = self._collective
            step = None if coll is None or coll.position is None else coll.position[0].step
            if coll is None:  # the ring is still forming: the peer's failure, not a deadline
                cls = RingError
            err = cls(
                f"{self.name(sender)} left the ring: {reason}",
                rank=self.rank,
                step=step,
                peer=self.addresses[sender],
            )
        log(f"rank {self.rank}: {self.name(sender)} aborted: {reason}")
        self._leave(err, tell_peers=False)
        return b""

    def _leave(self, err: RingError, tell_peers: bool = True) -> None:
        """Break the ring with ``err``: the collective at once, or, while the ring forms, the
        rendezvous and the wait for the data path (``on_abort``)."""
        with self._lock:
            coll = self._collective
            first = coll is None and self.aborted is None
            if first:
                self.aborted = err
        if coll is not None:
            coll.interrupt(err, "aborted", tell_peers=tell_peers)
        elif first and self.on_abort is not None:
            self.on_abort()

    def _state(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorise(context)
        coll = self._collective
        doc: dict = {"rank": self.rank, "started": 0, "current": None}
        if coll is not None:
            doc["started"] = coll.started
            pos = coll.position
            if pos is not None:
                h = pos[0]
                doc["current"] = {
                    "seq": h.seq,
                    "step": h.step,
                    "tag": h.tag,
                    "received": coll.received,
                    "expected": coll.expected_bytes(h),
                }
        return json.dumps(doc).encode()

    # -- client side ----------------------------------------------------------------------------

    def registered(self, r: int, incarnation: str) -> None:
        """Rank ``r`` answered as ``incarnation``; an abort that process sent before its answer
        reached us fails this rendezvous now."""
        with self._lock:
            self.peer_incarnation[r] = incarnation
            early = self._unmatched.pop(r, None)
        if early is not None and early[0] == incarnation:
            raise RingError(
                f"{self.name(r)} left the ring: {early[1]}",
                rank=self.rank,
                step=-1,
                peer=self.addresses[r],
            )

    def attach(self, collective) -> None:
        """From now on a peer's Abort interrupts ``collective``; one that came earlier does so
        at once. The ring's health service reads SERVING."""
        with self._lock:
            self._collective = collective
            early = self.aborted
        if early is not None:
            collective.interrupt(early, "aborted", tell_peers=False)
        else:
            self.health.set(RING_HEALTH, health_pb2.HealthCheckResponse.SERVING)

    def tell_peers(self, reason: str, timeout: bool = False) -> None:
        """Send Abort(reason) to every peer (``timeout``: the ring broke on a silent peer, and
        the peers' errors are PeerTimeouts too) (once, without waiting; :meth:`close` waits up to
        ``ABORT_GRACE_S`` for delivery). A peer that is gone already just fails the call."""
        with self._lock:
            if self._told or self._closed:
                return
            self._told = True
        self.health.set(RING_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
        md = call_metadata(self._token, self.rank, self.world)
        for r in range(self.world):
            if r != self.rank:
                self._pending.append(
                    self.channel(r)
                    .unary_unary(
                        f"/{SERVICE}/Abort", request_serializer=None, response_deserializer=None
                    )
                    .future(
                        json.dumps(
                            {
                                "reason": reason[:2000],
                                "timeout": timeout,
                                "incarnation": self.incarnation,
                            }
                        ).encode(),
                        metadata=md,
                        timeout=ABORT_GRACE_S,
                    )
                )

    def metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """What this worker's calls to its peers carry: token, rank, ring size."""
        return call_metadata(self._token, self.rank, self.world)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        end = time.monotonic() + ABORT_GRACE_S
        for call in self._pending:
            with contextlib.suppress(
                grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError
            ):
                call.result(timeout=max(0.0, end - time.monotonic()))
        self.health.enter_graceful_shutdown()
        for ch in list(self._channels.values()):
            ch.close()
        self.server.stop(grace=0.5)
        if self.health_server is not None:
            self.health_server.stop(grace=0.5)
