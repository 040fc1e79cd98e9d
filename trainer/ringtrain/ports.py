"""Ring ports: where a ring member's side channel listens, and free loopback ports that leave
room for it.

A ring member listens on its ring port (the gRPC control plane, TF_CONFIG's address) and, with
the ``grpc+tcp`` data path, on :func:`side_channel_port` of it (``ring-data`` in the pod; the
trainer falls back to any free port where that is taken and announces what it bound). The
operator's pod ports, the trainer's listener, ``ringtrain run``'s loopback endpoints, the
benchmarks and the tests all take the rule from here, so they cannot drift apart.

On one host several members share the port space: :func:`free_ring_ports` hands out ports whose
side-channel port is free too and is no other member's ring port (seen in CI: one member's side
channel took the next member's ring port, and that member could not listen).
"""

from __future__ import annotations

import socket
from collections.abc import Collection


def side_channel_port(ring_port: int) -> int:
    """The port a member's ``grpc+tcp`` side channel listens on first: its ring port + 1."""
    return ring_port + 1


def member_ports(ring_port: int) -> tuple[int, int]:
    """Both ports a member listens on: its ring port and its side channel's."""
    return ring_port, side_channel_port(ring_port)


def free_ring_ports(n: int, *, taken: Collection[int] = (), host: str = "127.0.0.1") -> list[int]:
    """``n`` ports the kernel just handed out as free on ``host``, each with its side-channel
    port free as well, and no port of one member (ring or side channel) a port of another or in
    ``taken``. Everything stays bound until all are chosen, so the kernel cannot offer one port
    twice; a port whose side channel is not free stays bound too, so it is not offered again."""
    avoid = set(taken)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            ring, side = socket.socket(), socket.socket()
            held += [ring, side]
            ring.bind((host, 0))
            port = ring.getsockname()[1]
            if avoid.intersection(member_ports(port)):
                continue
            try:
                side.bind((host, side_channel_port(port)))
            except (OSError, OverflowError):
                continue
            ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()
