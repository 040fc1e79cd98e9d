"""A live peer that drips its ring bytes (issue 20, item 6): real ring members as processes, one
link of the ring through a real TCP proxy (a thread here) that forwards the side channel's
tensor bytes one every 0.05 s once told to. Each byte restarts the step timeout, so before
the per-collective deadline the ring hung forever; now the link is named and left, retryable.

Worker-0 is told that worker-1 lives on 127.0.0.2 (loopback too), where the proxy listens on
worker-1's ring and side-channel ports and forwards to 127.0.0.1: the control plane at full
speed (health checks pass: the peer is live), the side channel as the test says.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import ring_procs

from ringtrain.errors import EXIT_RETRYABLE
from ringtrain.ports import side_channel_port

PROXY_HOST = "127.0.0.2"


class Proxy:
    """Forwards ``listen_port`` on :data:`PROXY_HOST` to ``target_port`` on 127.0.0.1. The
    client-to-server direction goes at full speed until :attr:`drip_s` (one byte per that many
    seconds) or :attr:`rate` (bytes/s) is set; pacing is what is under test, not a wait."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.target = target_port
        self.drip_s: float | None = None
        self.rate: float | None = None
        self.dripped = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._sock = socket.create_server((PROXY_HOST, listen_port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # not up yet: refused, as the worker itself would
                conn.close()
                continue
            self._conns += (conn, up)
            for src, dst, paced in ((conn, up, True), (up, conn, False)):
                threading.Thread(target=self._pump, args=(src, dst, paced), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while data := src.recv(16384):
                if paced and self.drip_s is not None:
                    for i in range(len(data)):
                        dst.sendall(data[i : i + 1])
                        self.dripped += 1
                        if self._stop.wait(self.drip_s):
                            return
                    continue
                dst.sendall(data)
                if paced and self.rate is not None and self._stop.wait(len(data) / self.rate):
                    return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for s in self._conns:
            s.close()


def proxied_ring(world: int, *args: str) -> tuple[ring_procs.Ring, list[Proxy]]:
    """A ``loop``/``worker`` ring whose link worker-0 → worker-1 runs through proxies."""
    ring = ring_procs.start(world, *args, ranks=[])
    port = int(ring.addresses[1].rsplit(":", 1)[1])
    proxies = [Proxy(port, port), Proxy(side_channel_port(port), side_channel_port(port))]
    seen_by_0 = list(ring.addresses)
    seen_by_0[1] = f"{PROXY_HOST}:{port}"
    ring.extra = {0: ["--addresses", ",".join(seen_by_0)]}
    for r in range(world):
        ring.start_rank(r)
    return ring, proxies


#: a step timeout well above a loaded machine's scheduling hiccups (2 s was seen to fire)
ARGS = ("--chunk-bytes", "4096", "--step-timeout-s", "4", "--health-timeout-s", "3")


@pytest.mark.timeout(60)
def test_a_peer_dripping_its_bytes_is_named_and_left_within_its_deadline():
    """3 workers, 1024-float allreduces in one-float chunks: the deadline is 4 s (step
    timeout) + 5,464 bytes at 1 MiB/s. Dripping, worker-1 gets a byte every 0.05 s and passes
    each float on (a collective's 40-byte header takes 2 s), so no rank waits 4 s for a byte
    (the step timeout never fires); every rank
    leaves with the retryable code, naming the link worker-0 → worker-1 and the bytes
    delivered, within the deadline plus the watchdog's period and one State round."""
    ring, proxies = proxied_ring(
        3, "loop", "grpc+tcp", "--sizes", "1024", *ARGS, "--chunk-bytes", "4"
    )
    try:
        assert [ring.event(r)["event"] for r in range(3)] == ["started"] * 3
        t0 = time.monotonic()
        proxies[1].drip_s = 0.05
        errors = [ring.event(r) for r in range(3)]
        took = time.monotonic() - t0
        codes = [p.wait(timeout=10) for p in ring.procs]
    finally:
        ring.kill()
        for p in proxies:
            p.close()
    assert codes == [EXIT_RETRYABLE] * 3, errors
    assert all(e["event"] == "error" and e["type"] == "PeerTimeout" for e in errors), errors
    assert not any("no data for" in e["message"] for e in errors), errors
    assert proxies[1].dripped >= 2  # live: bytes kept coming, each one inside the step timeout
    assert took < 4 + 0.5 + 1 + 2.5, took  # deadline + watchdog period + State round + slack
    named = [e["message"] for e in errors if "delivered" in e["message"]]
    assert named, errors
    print(json.dumps({"slow_drip_left_after_s": round(took, 2), "message": named[0]}))
    for msg in named:
        assert "worker-0" in msg and "to worker-1" in msg and "of 5464 bytes" in msg, msg
        assert "ring.minBytesPerSecond" in msg, msg


@pytest.mark.timeout(60)
def test_a_slow_but_legal_link_above_the_floor_trains_to_the_end():
    """The same proxied ring, the link throttled to 2 MiB/s (above the 1 MiB/s floor) for the
    whole run, 1 MiB buckets: every collective takes longer than on loopback, none is past its
    deadline, and every rank's results are exact (``worker`` scenario checks each)."""
    ring, proxies = proxied_ring(
        3, "worker", "grpc+tcp", "--sizes", "1000,262147", "--steps", "3", *ARGS
    )
    proxies[1].rate = 2 * (1 << 20)
    try:
        results = ring.finish(timeout_s=45)
    finally:
        ring.kill()
        for p in proxies:
            p.close()
    assert [code for code, _ in results] == [0, 0, 0], results
    assert all(evs[-1]["event"] == "done" for _, evs in results), results
