"""What the ring reports: each collective, the data path, each break and stall.

Pipeline position: ``ring.engine.RingCollective`` and ``ring.watchdog`` call a
:class:`RingObserver`; ``telemetry.metrics.RingMetrics`` implements it as ``ringtrain_ring_*``.
Its own module so the telemetry layer sees the interface without the ring's machinery.
"""

from __future__ import annotations

#: How a ring breaks: a silent peer, a failed link, a collective interrupted half-way, a peer
#: that told us it failed, or a neighbour the watchdog's health checks lost.
ERROR_KINDS = ("timeout", "link", "interrupted", "aborted", "lost")
#: What a finished collective was (a barrier is an allreduce that only measures waiting).
COLLECTIVE_KINDS = ("allreduce", "broadcast", "barrier")


class RingObserver:
    """Where the ring reports what it did; ``telemetry.metrics.RingMetrics`` exports it
    as ``ringtrain_ring_*``, this default forgets it. Called on the communication thread once
    per collective with plain numbers, so the hot path builds no objects for it."""

    def collective(self, kind: str, seconds: float, sent_bytes: int, received_bytes: int) -> None:
        """A collective of ``kind`` (one of ``COLLECTIVE_KINDS``) finished."""

    def data_path(self, name: str) -> None:
        """The data path that runs (``grpc+tcp``, ``grpc+shm``, ``grpc``…), once connected:
        the ``transport`` label of what follows."""

    def error(self, kind: str) -> None:
        """The ring broke; ``kind`` is one of ``ERROR_KINDS``."""

    def waiting(self, names: list[str]) -> None:
        """At start-up: the peers (task names) that have not answered yet; [] once all did."""

    def stalled(self, report: dict | None) -> None:
        """A collective has waited past the stall threshold: what it waits for (a dict of
        seq, step, tag, waited_s and the missing ranks); None once it moved on."""
