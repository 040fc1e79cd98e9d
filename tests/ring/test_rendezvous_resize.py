"""An elastic job's rendezvous (decision 0217): a peer of another ring size is waited for (it is
still at the size before a resize), and a change of the job's size ends the wait, retryably."""

from __future__ import annotations

import threading

import pytest
from support.ports import free_ports

from ringtrain.errors import InvalidSpec, RingError
from ringtrain_trainer.ring.control import ControlPlane
from ringtrain_trainer.ring.rendezvous import rendezvous

TOKEN = b"t" * 32


def plane(rank: int, ports: list[int]) -> ControlPlane:
    addresses = tuple(f"127.0.0.1:{p}" for p in ports)
    names = tuple(f"worker-{i}" for i in range(len(ports)))
    p = ControlPlane(rank, addresses, names, TOKEN, ports[rank])
    p.start()
    return p


@pytest.mark.timeout(60)
def test_a_peer_of_another_size_is_a_tf_config_error_unless_the_job_is_elastic():
    a, b, c = free_ports(3)
    old = plane(1, [a, b])  # worker 1 still in the ring of 2
    new = plane(0, [a, b, c])  # worker 0 re-formed at 3
    try:
        with pytest.raises(InvalidSpec, match="ring size 3 is not 2"):
            rendezvous(new, 10)
        resized = threading.Event()
        threading.Timer(1.0, resized.set).start()  # the size changes again meanwhile
        with pytest.raises(RingError, match="resized while the ring formed"):
            rendezvous(new, 30, elastic=True, resized=resized)
    finally:
        old.close()
        new.close()


@pytest.mark.timeout(60)
def test_an_elastic_ring_of_one_serves_its_probes_and_answers_a_peer_with_its_size():
    """Shrunk to one worker, the ring's server stays up: a liveness probe would restart the
    container otherwise, and the worker the job grows back to waits for it to re-form."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ringtrain import cluster
    from ringtrain_trainer import ring
    from ringtrain_trainer.collective import LocalCollective

    a, b = free_ports(2)
    spec = cluster.parse(cluster.build({"worker": [f"127.0.0.1:{a}"]}, "worker", 0))
    assert type(ring.connect(spec, TOKEN)) is LocalCollective  # a fixed job of one: no server
    alone = ring.connect(spec, TOKEN, elastic=True)
    grower = plane(1, [a, b])
    try:
        assert isinstance(alone, LocalCollective)
        with grpc.insecure_channel(f"127.0.0.1:{a}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        resized = threading.Event()
        threading.Timer(1.0, resized.set).start()
        with pytest.raises(RingError, match="resized while the ring formed"):
            rendezvous(grower, 30, elastic=True, resized=resized)
    finally:
        grower.close()
        alone.close()
