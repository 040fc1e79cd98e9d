"""Ring allreduce between the workers of one job (see ``trainer.collective.Collective``).

``connect(spec, token)`` is the whole public surface: it starts this worker's gRPC server on the
port of its own TF_CONFIG address (the control plane, ``control``), registers with every peer
(the readiness barrier), opens the data path to both ring neighbours (ordered by rank as
``ClusterSpec.ring`` lists them) and returns a ``Collective``. Layers, bottom up: ``schedule``
(pure chunk plan), ``protocol`` (the per-collective header), ``auth`` (token checks),
``tls`` (mutual TLS with the job's certificate), ``channels`` (every gRPC server and
channel), ``control`` + ``watchdog`` (rendezvous, health, aborts, stall reports), ``tcp`` /
``grpc_transport`` (the data paths ``grpc+tcp`` and ``grpc``), ``shm`` (``grpc+tcp``'s links
between processes of one host through shared memory: ``grpc+shm``), ``engine`` (the algorithm
over a data path), ``malloc_tuning`` (glibc settings for a ring process, applied by the worker).
"""

from __future__ import annotations

import threading

from ringtrain import options, pki
from ringtrain.cluster import ClusterSpec, split_address
from ringtrain.errors import InvalidSpec, PeerTimeout, RingError
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain_trainer.ring import channels, schedule
from ringtrain_trainer.ring import tls as ring_tls
from ringtrain_trainer.ring.channels import MAX_MESSAGE_BYTES
from ringtrain_trainer.ring.control import ControlPlane, log
from ringtrain_trainer.ring.engine import RingCollective
from ringtrain_trainer.ring.grpc_transport import GrpcTransport
from ringtrain_trainer.ring.observer import RingObserver
from ringtrain_trainer.ring.rendezvous import rendezvous
from ringtrain_trainer.ring.schedule import DEFAULT_CHUNK_BYTES
from ringtrain_trainer.ring.shm import ShmTransport
from ringtrain_trainer.ring.transport import LinkError, Transport
from ringtrain_trainer.ring.watchdog import Watchdog

#: Accepted data path names: ``grpc+tcp`` (tensors on a raw TCP side channel opened through
#: gRPC; the faster, default), ``grpc`` (tensors in gRPC streams) and ``tcp``, the old name of
#: ``grpc+tcp``, kept as an alias.
TRANSPORTS = options.TRANSPORTS
ALIASES = {"tcp": "grpc+tcp"}
DEFAULT_CONNECT_TIMEOUT_S: float = options.DEFAULTS["ring_connect_timeout_s"]
DEFAULT_STEP_TIMEOUT_S: float = options.DEFAULTS["ring_step_timeout_s"]
DEFAULT_HEALTH_TIMEOUT_S: float = options.DEFAULTS["ring_health_timeout_s"]
DEFAULT_STALL_S: float = options.DEFAULTS["ring_stall_warning_s"]
DEFAULT_MIN_BYTES_PER_S: float = options.DEFAULTS["ring_min_bytes_per_s"]

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_STEP_TIMEOUT_S",
    "TRANSPORTS",
    "RingCollective",
    "connect",
    "data_path",
]


def data_path(transport: str) -> str:
    """The data path a ``--ring-transport`` value runs (``tcp`` → ``grpc+tcp``)."""
    if transport not in TRANSPORTS:
        raise InvalidSpec(f"ring transport {transport!r}: choose one of {TRANSPORTS}")
    return ALIASES.get(transport, transport)


def connect(
    spec: ClusterSpec,
    token: bytes,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    transport: str = "grpc+tcp",
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
    stall_s: float = DEFAULT_STALL_S,
    min_bytes_per_s: float = DEFAULT_MIN_BYTES_PER_S,
    observer: RingObserver | None = None,
    tls: pki.JobMaterial | None = None,
    encrypt_data: bool = False,
    health_port: int = 0,
    shared_memory: bool = True,
    elastic: bool = False,
    resized: threading.Event | None = None,
) -> Collective:
    """Join the ring described by ``spec``; a single-member ring is a ``LocalCollective``.

    Peers that are not up yet (or whose names do not resolve yet) are retried with back-off
    until ``connect_timeout_s`` (then ``PeerTimeout`` naming the missing ranks), reported to
    ``observer.waiting`` meanwhile. During collectives a peer that aborts breaks the ring at
    once, a neighbour silent to health checks for ``health_timeout_s`` within seconds, and a
    silent data path after ``step_timeout_s``; a collective waiting ``stall_s`` is reported, and
    one past ``step_timeout_s`` plus its bytes at ``min_bytes_per_s`` is left naming the slow
    link (``Watchdog``).
    With the job's ``tls`` material every gRPC server and channel is mutual TLS;
    ``encrypt_data`` wraps the TCP side channel in it too (without material it is refused).
    ``health_port`` (non-zero) serves the Health service alone in plaintext there as well.
    ``shared_memory``: ``grpc+tcp`` links between processes of one host carry tensors through
    shared memory (``ring.shm``; not with ``encrypt_data``). ``elastic``: an elastic job's
    worker, for which a peer of another ring size is one still at the size before a resize
    (``ringtrain_trainer.elastic``), waited for like a peer not up yet; ``resized`` set while
    the ring forms ends the wait with a retryable :class:`RingError` (the size changed).
    """
    path = data_path(transport)
    if spec.world_size == 1:
        if elastic and token:  # still answers its probes, and its peers with its size
            return AloneServing(spec, token, tls, health_port)
        return LocalCollective()
    if not spec.in_ring:
        raise InvalidSpec(f"TF_CONFIG.task.type {spec.task_type!r} takes no part in the ring")
    if not token:
        raise InvalidSpec("ring token is empty: set RINGTRAIN_TOKEN_FILE or RINGTRAIN_TOKEN")
    if chunk_bytes < 4:
        raise InvalidSpec(f"chunk_bytes must be at least 4 (one float32), got {chunk_bytes}")
    if chunk_bytes > MAX_MESSAGE_BYTES - (64 << 10):
        raise InvalidSpec(
            f"chunk_bytes {chunk_bytes} must leave 64 KiB of the largest gRPC message "
            f"({MAX_MESSAGE_BYTES}) for framing"
        )
    if encrypt_data and tls is None:
        raise InvalidSpec(
            "--ring-encrypt-data needs the job's TLS material (RINGTRAIN_TLS_DIR or --ring-tls-dir)"
        )
    observer = observer if observer is not None else RingObserver()
    material = ring_tls.Material.of(tls) if tls is not None else None
    data_tls = material if encrypt_data else None
    rank, addresses = spec.rank, spec.ring
    try:
        control = ControlPlane(
            rank,
            addresses,
            spec.ring_names,
            token,
            split_address(addresses[rank])[1],
            material,
            health_port=health_port,
        )
    except channels.BindError as e:  # our own port is taken: retryable, a new pod may get it
        raise RingError(str(e), rank=rank, step=-1, peer=addresses[rank]) from None
    listener = receiver = None
    try:
        if path == "grpc+tcp":
            listener = ShmTransport.listen(rank, addresses, data_tls)
            control.data_port, control.data_key = listener.port, listener.key
            control.on_abort = listener.wake
        else:
            receiver, handler = GrpcTransport.receiver(
                rank, len(addresses), token, step_timeout_s, material
            )
            control.add_handlers(handler)
        control.start()
        answers = rendezvous(
            control, connect_timeout_s, observer.waiting, elastic=elastic, resized=resized
        )
        security = (
            "mutual TLS" + (", side channel encrypted" if encrypt_data else "")
            if material is not None
            else "TLS off: control calls and the side-channel key in the clear"
        )
        log(f"rank {rank}: all {len(addresses)} ranks answered; data path {path}, {security}")
        wire: Transport
        if listener is not None:
            right = schedule.right(rank, len(addresses))
            side = answers[right]
            if side.get("data_port") is None or not side.get("data_key"):
                raise InvalidSpec(
                    f"rank {rank}: {addresses[right]} announced no grpc+tcp side "
                    "channel (do all workers use the same --ring-transport?)"
                )
            wire = ShmTransport.open(
                listener,
                rank,
                addresses,
                int(side["data_port"]),
                bytes.fromhex(side["data_key"]),
                connect_timeout_s=connect_timeout_s,
                step_timeout_s=step_timeout_s,
                material=data_tls,
                chunk_bytes=chunk_bytes,
                shared_memory=shared_memory and not encrypt_data,
            )
            if wire.links != ("tcp", "tcp"):
                log(
                    f"rank {rank}: data path {wire.name}: tensors from the left neighbour over "
                    f"{wire.links[0]}, to the right over {wire.links[1]} (same-host shared "
                    "memory, signalled over the TCP side channel)"
                )
        else:
            assert receiver is not None  # made above on this path
            wire = GrpcTransport.open(
                receiver,
                rank,
                addresses,
                token,
                connect_timeout_s=connect_timeout_s,
                step_timeout_s=step_timeout_s,
                material=material,
            )
    except LinkError as e:  # our own side-channel port is taken: retryable
        control.close()
        raise RingError(str(e), rank=rank, step=-1, peer=addresses[rank]) from None
    except BaseException as e:
        if listener is not None:
            listener.close()
        control.close()
        if isinstance(e, PeerTimeout) and control.aborted is not None:
            raise control.aborted from None  # the wait ended because the ring broke
        raise
    coll = RingCollective(
        wire,
        rank,
        addresses,
        chunk_bytes=chunk_bytes,
        step_timeout_s=step_timeout_s,
        min_bytes_per_s=min_bytes_per_s,
        control=control,
    )
    coll.observer = observer
    observer.data_path(wire.name)
    control.attach(coll)
    coll.watchdog = Watchdog(control, coll, health_timeout_s=health_timeout_s, stall_s=stall_s)
    return coll


class AloneServing(LocalCollective):
    """An elastic job's ring of one: every collective the identity, but the control plane's
    server runs on the ring's port as in a larger ring — the pod's gRPC health probes keep
    answering (a liveness probe would restart the container otherwise), and a worker of the
    size the job grows back to is answered with this ring's size (refused as another size,
    which an elastic rendezvous waits through) until this one re-forms at it."""

    def __init__(
        self, spec: ClusterSpec, token: bytes, tls: pki.JobMaterial | None, health_port: int
    ) -> None:
        material = ring_tls.Material.of(tls) if tls is not None else None
        address = spec.ring[spec.rank]
        try:
            self.plane = ControlPlane(
                spec.rank,
                spec.ring,
                spec.ring_names,
                token,
                split_address(address)[1],
                material,
                health_port=health_port,
            )
        except channels.BindError as e:
            raise RingError(str(e), rank=spec.rank, step=-1, peer=address) from None
        self.plane.start()

    def close(self) -> None:
        self.plane.close()
