"""``ringtrain run`` puts a whole job on loopback; its workers listened on every interface, so
their unauthenticated ports (ring, side channel, health, metrics) were reachable from the LAN
(issue 20, item 3). A member of a cluster that is all on loopback now binds loopback; a pod
(peers by DNS name) still binds every interface."""

from __future__ import annotations

import os
import time

import pytest
from support.ports import free_ports
from test_connection_flood import wait_listening, worker

from ringtrain.cluster import ANY, LOOPBACK, bind_host
from ringtrain_localrun import plan


@pytest.mark.parametrize(
    "addresses, host",
    [
        (["127.0.0.1:2222", "127.0.0.1:2224"], LOOPBACK),
        (["localhost:2222", "[::1]:2222", "127.0.0.9:1"], LOOPBACK),
        (["127.0.0.1:2222", "10.0.0.2:2222"], ANY),
        (["mnist-worker-0.mnist.team-a.svc:2222"], ANY),
        ([], ANY),
    ],
)
def test_a_cluster_all_on_loopback_binds_loopback(addresses, host):
    assert bind_host(addresses) == host


def listening(pid: int) -> set[str]:
    """The local addresses of the TCP sockets ``pid`` listens on (hex, as /proc/net shows)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.add(cols[1].rsplit(":", 1)[0])
    return out


def test_a_worker_of_a_local_run_listens_on_loopback_only(tmp_path):
    ports = free_ports(4)  # no port is another's side channel (+1)
    ring, metrics = ports[:2], ports[2:]
    addrs = [f"127.0.0.1:{p}" for p in ring]  # what ringtrain run's plan gives its workers
    w0 = worker(0, addrs, metrics[0], tmp_path / "c")
    try:
        wait_listening(ring[0])
        wait_listening(metrics[0])
        time.sleep(0.2)
        bound = listening(w0.pid)
    finally:
        w0.kill()
        w0.communicate()
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1 (gRPC binds IPv4 through a dual-stack socket)
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert bound and bound <= loopback, f"worker 0 listens on {bound}"


def test_the_local_plan_puts_every_replica_on_loopback():
    endpoint = plan.loopback_endpoints(plan.port_allocator())
    addresses = [endpoint(None, "worker", i) for i in range(3)]  # type: ignore[arg-type]
    assert bind_host(addresses) == LOOPBACK
