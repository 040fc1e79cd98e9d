"""Cluster DNS for the local test cluster (hack/local-cluster), standing in for CoreDNS.

Debian packages no CoreDNS, so this responder answers the Kubernetes DNS names that pods of
ringtrain need, from Services and Endpoints it lists and then watches on the API server:

- ``<svc>.<ns>.svc.<domain>``: the ClusterIP, or for a headless Service every endpoint address
  (with ``publishNotReadyAddresses`` the endpoints controller lists pods before they are Ready);
- ``<hostname>.<svc>.<ns>.svc.<domain>``: the endpoint whose ``hostname`` is that (pods with
  ``hostname`` and ``subdomain`` set, as the operator creates them);
- ``<a-b-c-d>.<ns>.pod.<domain>``: the address a.b.c.d.

Other names under the domain get NXDOMAIN; names outside it are forwarded to the host's resolver.
Run with the project's virtualenv: ``.venv/bin/python hack/lib/cluster_dns.py --kubeconfig FILE``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass, field

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer
from kubernetes import client, config, watch

log = logging.getLogger("ringtrain-dns")

WATCH_TIMEOUT_S = 240
RETRY_DELAY_S = 1.0


@dataclass
class Records:
    """The current view of Services and Endpoints, updated by the watch threads."""

    cluster_ips: dict[tuple[str, str], str] = field(default_factory=dict)
    endpoints: dict[tuple[str, str], list[tuple[str, str | None]]] = field(default_factory=dict)
    synced: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_service(self, ns: str, name: str, cluster_ip: str | None) -> None:
        with self.lock:
            self.cluster_ips[(ns, name)] = cluster_ip or "None"

    def del_service(self, ns: str, name: str) -> None:
        with self.lock:
            self.cluster_ips.pop((ns, name), None)

    def set_endpoints(self, ns: str, name: str, subsets) -> None:
        addrs = [(a.ip, a.hostname) for s in subsets or [] for a in s.addresses or []]
        with self.lock:
            self.endpoints[(ns, name)] = addrs

    def del_endpoints(self, ns: str, name: str) -> None:
        with self.lock:
            self.endpoints.pop((ns, name), None)

    def lookup(self, labels: list[str]) -> list[str] | None:
        """Addresses for a name below the cluster domain (labels without it); None: no such name."""
        with self.lock:
            if len(labels) == 3 and labels[2] == "svc":
                svc, ns = labels[0], labels[1]
                ip = self.cluster_ips.get((ns, svc))
                if ip is None:
                    return None
                if ip != "None":
                    return [ip]
                return [a for a, _ in self.endpoints.get((ns, svc), [])]
            if len(labels) == 4 and labels[3] == "svc":
                host, svc, ns = labels[0], labels[1], labels[2]
                if (ns, svc) not in self.cluster_ips:
                    return None
                found = [a for a, h in self.endpoints.get((ns, svc), []) if h == host]
                return found or None
            if len(labels) == 3 and labels[2] == "pod":
                try:
                    return [str(ipaddress.IPv4Address(labels[0].replace("-", ".")))]
                except ValueError:
                    return None
        return None


def watch_forever(kind: str, list_fn, on_event, records: Records) -> None:
    """List then watch one resource kind for ever, relisting after errors or expiry."""
    while True:
        try:
            listing = list_fn()
            for obj in listing.items:
                on_event("ADDED", obj)
            records.synced.add(kind)
            log.info("%s: %d listed", kind, len(listing.items))
            rv = listing.metadata.resource_version
            w = watch.Watch()
            for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=WATCH_TIMEOUT_S):
                on_event(ev["type"], ev["object"])
        except Exception as exc:  # noqa: BLE001 - API server restarting, 410 Gone, ...: relist
            log.warning("%s watch failed (%s); relisting", kind, exc)
            time.sleep(RETRY_DELAY_S)


class ClusterResolver(BaseResolver):
    def __init__(
        self, records: Records, domain: str, upstream: list[str], ttl: int, upstream_port: int = 53
    ) -> None:
        self.records = records
        self.domain = domain.strip(".").lower()
        self.upstream = upstream
        self.upstream_port = upstream_port
        self.ttl = ttl

    def resolve(self, request, handler):
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".").lower()
        if qname == self.domain or qname.endswith("." + self.domain):
            if len(self.records.synced) < 2:
                reply.header.rcode = RCODE.SERVFAIL  # not synced yet: clients retry
                return reply
            prefix = qname[: -len(self.domain)].rstrip(".")
            labels = prefix.split(".") if prefix else []
            addrs = self.records.lookup(labels)
            if addrs is None:
                reply.header.rcode = RCODE.NXDOMAIN
                log.debug("NXDOMAIN %s", qname)
            elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
                for addr in addrs:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(addr), ttl=self.ttl))
            return reply  # known name, other type (AAAA, ...): NOERROR without answers
        return self.forward(request, reply)

    def forward(self, request, reply):
        for server in self.upstream:
            try:
                data = request.send(server, self.upstream_port, timeout=2)
                return DNSRecord.parse(data)
            except OSError as exc:  # includes TimeoutError
                log.debug("upstream %s failed for %s: %s", server, request.q.qname, exc)
        reply.header.rcode = RCODE.SERVFAIL
        return reply


def host_nameservers(exclude: str) -> list[str]:
    servers = []
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and parts[1] != exclude:
                    servers.append(parts[1])
    except OSError:
        pass
    return servers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--listen", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=53)
    p.add_argument("--domain", default="cluster.local")
    p.add_argument("--ttl", type=int, default=5, help="answer TTL in seconds")
    p.add_argument(
        "--upstream", action="append", help="forwarders (default: the host's resolv.conf)"
    )
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    config.load_kube_config(config_file=args.kubeconfig)
    v1 = client.CoreV1Api()
    records = Records()

    def on_service(kind, svc):
        if kind == "DELETED":
            records.del_service(svc.metadata.namespace, svc.metadata.name)
        else:
            records.set_service(svc.metadata.namespace, svc.metadata.name, svc.spec.cluster_ip)

    def on_endpoints(kind, ep):
        if kind == "DELETED":
            records.del_endpoints(ep.metadata.namespace, ep.metadata.name)
        else:
            records.set_endpoints(ep.metadata.namespace, ep.metadata.name, ep.subsets)
            log.debug(
                "endpoints %s/%s: %s",
                ep.metadata.namespace,
                ep.metadata.name,
                records.endpoints.get((ep.metadata.namespace, ep.metadata.name)),
            )

    for kind, fn, handler in (
        ("services", v1.list_service_for_all_namespaces, on_service),
        ("endpoints", v1.list_endpoints_for_all_namespaces, on_endpoints),
    ):
        threading.Thread(
            target=watch_forever, args=(kind, fn, handler, records), name=kind, daemon=True
        ).start()

    resolver = ClusterResolver(
        records, args.domain, args.upstream or host_nameservers(args.listen), args.ttl
    )
    servers = [
        DNSServer(resolver, address=args.listen, port=args.port, tcp=tcp, logger=_QuietLogger())
        for tcp in (False, True)
    ]
    for s in servers:
        s.start_thread()
    log.info(
        "serving %s on %s:%d (upstream %s)", args.domain, args.listen, args.port, resolver.upstream
    )
    try:
        while all(s.isAlive() for s in servers):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    return 1


class _QuietLogger:
    """dnslib's per-query logging off; errors still go to our log."""

    def log_recv(self, *a): ...
    def log_send(self, *a): ...
    def log_request(self, *a): ...
    def log_reply(self, *a): ...
    def log_truncated(self, *a): ...
    def log_data(self, *a): ...

    def log_error(self, handler, e):
        log.warning("error handling a query from %s: %s", handler.client_address, e)


if __name__ == "__main__":
    raise SystemExit(main())
