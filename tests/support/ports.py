"""Free loopback ports for the tests, by the ring's rule (``ringtrain.ports``): every port comes
with its side-channel port free, and no port handed out at once is another's side channel.

One rule for every port a test needs (ring, metrics, HTTP, Prometheus): a port that is free
only by itself is a ring port waiting to clash.
"""

from __future__ import annotations

from ringtrain.ports import free_ring_ports, side_channel_port

__all__ = ["free_port", "free_ports", "loopback_addresses", "side_channel_port"]


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free right now, each with its side-channel port free as well."""
    return free_ring_ports(n)


def free_port() -> int:
    """One loopback port free right now (and its side-channel port)."""
    return free_ring_ports(1)[0]


def loopback_addresses(n: int) -> list[str]:
    """``n`` ring addresses on 127.0.0.1, in rank order."""
    return [f"127.0.0.1:{p}" for p in free_ports(n)]
