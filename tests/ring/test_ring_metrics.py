"""The ring's statistics as the trainer's ``ringtrain_ring_*`` metrics, from real processes.

Two ring members (``ring_worker.py metrics``) each read their own injected registry with
``get_sample_value``: bytes per direction follow from the schedule exactly, the allreduce
histogram counts allreduces but not barriers, and a ring broken by a departing peer is counted
once, by kind, under the data path's ``transport`` label."""

import pytest
import ring_procs

N = 4096  # floats: two equal segments on two ranks
SEG = N * 4 // 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc+tcp", "grpc+shm", "grpc"])
def test_ring_bytes_allreduce_seconds_and_errors_are_exported(transport):
    ring = ring_procs.start(2, "metrics", transport, "--sizes", str(N))
    try:
        results = ring.finish(timeout_s=60)
    finally:
        ring.kill()
    got = {}
    for rank, (_, events) in enumerate(results):
        (m,) = [e for e in events if e["event"] == "metrics"]
        assert m["transport"] == transport
        assert m["labels"] == [transport]  # no series names a data path that did not run
        got[rank] = m
    # per allreduce each rank sends and receives 2(N-1) = 2 segments; a barrier 2 floats
    per_allreduce, barrier, bcast = 2 * SEG, 2 * 4, N * 4
    assert got[0]["sent"] == 3 * per_allreduce + barrier + bcast  # rank 0 is the root
    assert got[0]["received"] == 3 * per_allreduce + barrier
    assert got[1]["sent"] == 3 * per_allreduce + barrier  # its right neighbour is the root
    assert got[1]["received"] == 3 * per_allreduce + barrier + bcast
    for m in got.values():
        assert m["allreduces"] == 3 and m["allreduce_s"] > 0  # the barrier is not timed
    assert got[1]["errors"] == {"timeout": 0, "link": 0, "interrupted": 0}
    assert [e["type"] for e in results[0][1] if e["event"] == "broke"] == ["RingError"]
    assert got[0]["errors"] == {"timeout": 0, "link": 1, "interrupted": 0}


def test_a_single_worker_or_mpi_has_no_ring_to_watch():
    from prometheus_client import CollectorRegistry

    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.telemetry.metrics import TrainerMetrics

    registry = CollectorRegistry()
    TrainerMetrics(registry=registry).watch_ring(LocalCollective())
    assert (
        registry.get_sample_value(
            "ringtrain_ring_bytes_total", {"direction": "sent", "transport": "tcp"}
        )
        is None
    )
