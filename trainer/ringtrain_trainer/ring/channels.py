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

#: Unlimited message sizes and large HTTP/2 windows: data-path chunks are ~1 MiB.
OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ("grpc.http2.bdp_probe", 1),
    ("grpc.so_reuseport", 0),
]


class BindError(OSError):
    """The port is taken (or not ours to take)."""


def server(
    port: int, *, host: str = "0.0.0.0", max_workers: int = 12, material: tls.Material | None = None
) -> grpc.Server:
    """A gRPC server bound to ``host:port`` but not started (handlers are added first); with
    ``material`` it requires a client certificate of the job's CA."""
    srv = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ring-rpc"),
        options=OPTIONS,
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
