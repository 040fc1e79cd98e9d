"""The cluster DNS responder (hack/lib/cluster_dns.py) as a real UDP/TCP server on loopback, fed
with Services and Endpoints the way its watch threads feed it (no cluster needed)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import cluster_dns as dns
import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer


def endpoints(*addrs):
    return [NS(addresses=[NS(ip=ip, hostname=host) for ip, host in addrs])]


class Upstream(BaseResolver):
    def resolve(self, request, handler):
        reply = request.reply()
        reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A("192.0.2.99"), ttl=60))
        return reply


def serve(resolver, tcp=False):
    server = DNSServer(resolver, address="127.0.0.1", port=0, tcp=tcp, logger=dns._QuietLogger())
    server.start_thread()
    return server, server.server.server_address[1]


@pytest.fixture(scope="module")
def responder():
    """The responder on loopback (UDP and TCP) with a fake upstream; records set per test."""
    upstream, up_port = serve(Upstream())
    resolver = dns.ClusterResolver(
        dns.Records(), "cluster.local", ["127.0.0.1"], ttl=5, upstream_port=up_port
    )
    servers = [serve(resolver), serve(resolver, tcp=True)]
    yield resolver, servers[0][1], servers[1][1]
    for s, _ in [*servers, (upstream, 0)]:
        s.stop()
        s.server.server_close()


@pytest.fixture
def records(responder):
    r = dns.Records()
    r.set_service("ns1", "kubernetes", "10.0.0.1")
    r.set_service("ns1", "peers", "None")
    r.set_endpoints(
        "ns1", "peers", endpoints(("10.244.0.5", "job-worker-0"), ("10.244.0.6", "job-worker-1"))
    )
    r.synced.update({"services", "endpoints"})
    responder[0].records = r
    return r


@pytest.fixture
def query(responder, records):
    _, udp_port, tcp_port = responder

    def ask(name, qtype="A", tcp=False):
        q = DNSRecord.question(name, qtype)
        reply = DNSRecord.parse(
            q.send("127.0.0.1", tcp_port if tcp else udp_port, tcp=tcp, timeout=3)
        )
        return RCODE[reply.header.rcode], sorted(str(rr.rdata) for rr in reply.rr)

    return ask


def test_cluster_ip_service(query):
    assert query("kubernetes.ns1.svc.cluster.local") == ("NOERROR", ["10.0.0.1"])


def test_headless_service_answers_every_endpoint(query):
    assert query("peers.ns1.svc.cluster.local") == ("NOERROR", ["10.244.0.5", "10.244.0.6"])


def test_pod_hostname_under_headless_service_over_udp_and_tcp(query):
    assert query("job-worker-1.peers.ns1.svc.cluster.local") == ("NOERROR", ["10.244.0.6"])
    assert query("JOB-WORKER-0.peers.ns1.svc.cluster.local.", tcp=True) == (
        "NOERROR",
        ["10.244.0.5"],
    )


def test_unknown_names_in_the_domain_are_nxdomain(query):
    assert query("job-worker-2.peers.ns1.svc.cluster.local")[0] == "NXDOMAIN"
    assert query("peers.ns2.svc.cluster.local")[0] == "NXDOMAIN"
    # what a resolver tries first for `job-worker-0.peers.ns1.svc` with the pod's search list
    assert query("job-worker-0.peers.ns1.svc.ns1.svc.cluster.local")[0] == "NXDOMAIN"


def test_known_name_other_type_is_empty_noerror(query):
    assert query("kubernetes.ns1.svc.cluster.local", "AAAA") == ("NOERROR", [])


def test_pod_ip_names(query):
    assert query("10-244-0-9.ns1.pod.cluster.local") == ("NOERROR", ["10.244.0.9"])
    assert query("10-244-0.ns1.pod.cluster.local")[0] == "NXDOMAIN"


def test_deleted_objects_disappear(records, query):
    records.del_endpoints("ns1", "peers")
    assert query("job-worker-0.peers.ns1.svc.cluster.local")[0] == "NXDOMAIN"
    records.del_service("ns1", "kubernetes")
    assert query("kubernetes.ns1.svc.cluster.local")[0] == "NXDOMAIN"


def test_not_synced_yet_is_servfail_so_clients_retry(records, query):
    records.synced.discard("endpoints")
    assert query("kubernetes.ns1.svc.cluster.local")[0] == "SERVFAIL"


def test_other_names_are_forwarded_upstream(query):
    assert query("deb.debian.org") == ("NOERROR", ["192.0.2.99"])
