"""Where every gRPC server and channel of the ring is made: the one place that chooses its
security.

The control plane, the all-gRPC data path and the health probe all create their servers and
channels here. With the job's TLS material (``ring/tls.py``, from ``RINGTRAIN_TLS_DIR``) both are
mutual TLS with the job's CA; without it (a worker started by hand) both are insecure. The token
stays on every call either way: it is what tells a peer of this job from anything else that can
reach the port.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from ringtrain_trainer.ring import tls

#: The largest gRPC message a ring server or channel takes or sends: above the grpc data
#: path's chunks (``schedule.DEFAULT_CHUNK_BYTES``, 1 MiB; ``ring.connect`` refuses a chunk
#: size within 64 KiB of this) and far above the control plane's JSON. gRPC refuses a larger
#: message (RESOURCE_EXHAUSTED) by its length prefix, before the call's handler or token check
#: sees it: unlimited, one 1 GiB message on a port that serves without the job's token (Health;
#: the control port with TLS off) added 1.4 GB to a worker and broke its ring (issue 20).
MAX_MESSAGE_BYTES = 16 << 20
#: The health-only port (``--ring-health-port``) takes health checks of a few bytes.
HEALTH_MAX_MESSAGE_BYTES = 4 << 10
#: Milliseconds a connection to a ring server may take to become HTTP/2 (TLS, preface,
#: settings) before it is closed: gRPC's default is 120 s, so 1,500 idle connections from
#: anywhere (no token or certificate needed) held as many descriptors for two minutes and, at the
#: common 1024 open-files limit, failed the chief's next checkpoint write (issue 20).
HANDSHAKE_TIMEOUT_MS = 5_000
#: Connections a server accepts at once beyond :func:`connection_limit`'s per-peer share: the
#: operator's probes, a rejoining peer's new channel beside its old one.
SPARE_CONNECTIONS = 32


def connection_limit(world: int) -> int:
    """Connections a rank's ring server keeps open at once: each peer holds one control channel
    and at most one data-path channel to it. gRPC closes a connection over the limit as it
    accepts it, so a flood costs descriptors only up to here."""
    return 2 * world + SPARE_CONNECTIONS


def options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Bounded message sizes and large HTTP/2 windows: data-path chunks are ~1 MiB."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.so_reuseport", 0),
    ]


OPTIONS = options()


class BindError(OSError):
    """The port is taken (or not ours to take)."""


def server(
    port: int,
    *,
    host: str = "0.0.0.0",
    max_workers: int = 12,
    material: tls.Material | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_connections: int = SPARE_CONNECTIONS,
    interceptors: tuple[grpc.ServerInterceptor, ...] = (),
) -> grpc.Server:
    """A gRPC server bound to ``host:port`` but not started (handlers are added first); with
    ``material`` it requires a client certificate of the job's CA. It holds at most
    ``max_connections`` connections, each unauthenticated one for at most
    :data:`HANDSHAKE_TIMEOUT_MS`."""
    srv = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ring-rpc"),
        options=[
            *options(max_message_bytes),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            ("grpc.max_allowed_incoming_connections", max_connections),
        ],
        interceptors=list(interceptors),
        # calls beyond it are refused at once (RESOURCE_EXHAUSTED), never queued with their
        # messages read: every peer's control call and data stream fit, a flood does not
        maximum_concurrent_rpcs=max_connections,
    )
    bound = tls.serve(srv, f"{host}:{port}", material)
    if not bound:
        srv.stop(None)
        raise BindError(f"cannot listen on {host}:{port}")
    return srv


def channel(address: str, material: tls.Material | None = None) -> grpc.Channel:
    """A channel to a peer's ring port (or, for the health probe, to our own); with
    ``material`` mutual TLS, the server verified against the job's CA."""
    return tls.channel(address, material, OPTIONS)
