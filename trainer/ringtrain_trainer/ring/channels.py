"""Where every gRPC server and channel of the ring is made: the one place that chooses its
security.

The control plane, the all-gRPC data path and the health probe all create their servers and
channels here, so that switching them from the job's token on an insecure channel to mutual TLS
(``ring/tls.py``) changes these two functions and nothing else. The token stays on every call
either way: it is what tells a peer of this job from anything else that can reach the port.
"""

from __future__ import annotations

from concurrent import futures

import grpc

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


def server(port: int, *, host: str = "0.0.0.0", max_workers: int = 12) -> grpc.Server:
    """A gRPC server bound to ``host:port`` but not started (handlers are added first)."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                 thread_name_prefix="ring-rpc"),
                      options=OPTIONS)
    try:
        bound = srv.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound = 0
    if not bound:
        srv.stop(None)
        raise BindError(f"cannot listen on {host}:{port}")
    return srv


def channel(address: str) -> grpc.Channel:
    """A channel to a peer's ring port (or, for the health probe, to our own)."""
    return grpc.insecure_channel(address, options=OPTIONS)
