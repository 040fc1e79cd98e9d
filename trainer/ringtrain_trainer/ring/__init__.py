"""Ring allreduce between the workers of one job (see ``trainer.collective.Collective``).

``connect(spec, token)`` is the whole public surface: it authenticates to both ring neighbours
of this task (ordered by rank as ``ClusterSpec.ring`` lists them, listening on the port of this
task's own TF_CONFIG address) and returns a ``Collective``. Layers, bottom up: ``schedule``
(pure chunk plan), ``protocol`` (the per-collective header), ``auth`` (token checks),
``tcp`` / ``grpc_transport`` (the wires), ``engine`` (the algorithm over a wire).
"""

from __future__ import annotations

from ringtrain import options
from ringtrain.cluster import ClusterSpec
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain.errors import InvalidSpec, RingError
from ringtrain_trainer.ring.engine import RingCollective
from ringtrain_trainer.ring.transport import LinkError
from ringtrain_trainer.ring.schedule import DEFAULT_CHUNK_BYTES

#: Supported wires; ``tcp`` is the fast default, ``grpc`` the all-gRPC one.
TRANSPORTS = options.TRANSPORTS
DEFAULT_CONNECT_TIMEOUT_S: float = options.DEFAULTS["ring_connect_timeout_s"]
DEFAULT_STEP_TIMEOUT_S: float = options.DEFAULTS["ring_step_timeout_s"]

__all__ = ["connect", "RingCollective", "TRANSPORTS", "DEFAULT_CHUNK_BYTES",
           "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_STEP_TIMEOUT_S"]


def connect(spec: ClusterSpec, token: bytes, *,
            connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
            step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            transport: str = "tcp") -> Collective:
    """Join the ring described by ``spec``; a single-member ring is a ``LocalCollective``.

    Peers that are not up yet are retried with backoff until ``connect_timeout_s`` (then
    ``PeerTimeout``); during collectives a silent peer fails the call after ``step_timeout_s``.
    """
    if transport not in TRANSPORTS:
        raise InvalidSpec(f"ring transport {transport!r}: choose one of {TRANSPORTS}")
    if spec.world_size == 1:
        return LocalCollective()
    if not spec.in_ring:
        raise InvalidSpec(f"TF_CONFIG.task.type {spec.task_type!r} takes no part in the ring")
    if not token:
        raise InvalidSpec("ring token is empty: set RINGTRAIN_TOKEN_FILE or RINGTRAIN_TOKEN")
    if chunk_bytes < 4:
        raise InvalidSpec(f"chunk_bytes must be at least 4 (one float32), got {chunk_bytes}")
    rank, addresses = spec.rank, spec.ring
    if transport == "tcp":
        from ringtrain_trainer.ring.tcp import TcpTransport as wire_cls
    else:
        from ringtrain_trainer.ring.grpc_transport import GrpcTransport as wire_cls
    try:
        wire = wire_cls.open(rank, addresses, token, connect_timeout_s=connect_timeout_s,
                             step_timeout_s=step_timeout_s)
    except LinkError as e:  # our own port is taken: retryable, a new pod may get it
        raise RingError(str(e), rank=rank, step=-1, peer=addresses[rank]) from None
    return RingCollective(wire, rank, addresses, chunk_bytes=chunk_bytes,
                          step_timeout_s=step_timeout_s)
