"""1,500 idle TCP connections to a worker's ring port, at the common 1024 open-files limit
(issue 20, item 3).

No token or certificate is needed to open a TCP connection, and gRPC held each one for its
default handshake timeout of 120 s: the worker ran out of descriptors and its next checkpoint
write failed (exit 1, which the ExitCode policy takes as permanent). Now a ring server holds at
most ``channels.connection_limit(world)`` connections, each for at most
``channels.HANDSHAKE_TIMEOUT_MS``. Real ``ringtrain worker`` processes on loopback: worker 0 is
flooded while it waits for its peer, then the job trains and checkpoints.
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time

from support.ports import free_ports
from test_hostile_traffic import TOKEN

from ringtrain.cluster import build
from ringtrain_trainer.ring import channels, links

FLOOD = 1500
NOFILE = 1024


def worker(i: int, addrs: list[str], metrics_port: int, ckpt) -> subprocess.Popen:
    env = dict(os.environ, RINGTRAIN_TOKEN=TOKEN, TF_CONFIG=build({"worker": addrs}, "worker", i))
    env.pop("RINGTRAIN_TOKEN_FILE", None)
    cmd = [
        *(sys.executable, "-m", "ringtrain.cli", "worker", "--dataset", "mnist-5k"),
        *("--steps", "4", "--batch-size", "6", "--seed", "7", "--json"),
        *("--metrics-port", str(metrics_port), "--checkpoint-dir", str(ckpt)),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_listening(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)  # the worker is still importing
    raise AssertionError(f"nothing listens on {port}")


def closed_within(socks: list[socket.socket], timeout_s: float) -> tuple[int, float]:
    """How many of ``socks`` the server closed within ``timeout_s``, and when the last did."""
    open_ = {s.fileno(): s for s in socks}
    start, last = time.monotonic(), 0.0
    poller = select.poll()
    for fd in open_:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while open_ and (left := start + timeout_s - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            try:
                gone = open_[fd].recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                poller.unregister(fd)
                del open_[fd]
                last = time.monotonic() - start
    return len(socks) - len(open_), last


def test_idle_connections_to_the_ring_port_are_bounded_and_the_job_trains(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4 * FLOOD), hard))
    ports = free_ports(4)  # no port is another's side channel (+1)
    ring, metrics = ports[:2], ports[2:]
    addrs = [f"127.0.0.1:{p}" for p in ring]
    w0 = worker(0, addrs, metrics[0], tmp_path / "c")
    socks: list[socket.socket] = []
    try:
        resource.prlimit(w0.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        wait_listening(ring[0])
        t0 = time.monotonic()
        for _ in range(FLOOD):
            try:
                socks.append(socket.create_connection(("127.0.0.1", ring[0]), timeout=5))
            except OSError:
                break  # the listen backlog is full: the server stopped accepting
        opened = time.monotonic() - t0
        closed, last_s = closed_within(socks, channels.HANDSHAKE_TIMEOUT_MS / 1000 + 5)
        print(
            json.dumps(
                {
                    "case": "1500 idle connections to the ring port",
                    "opened": len(socks),
                    "open_s": round(opened, 2),
                    "closed_by_worker": closed,
                    "last_closed_s": round(last_s, 2),
                }
            )
        )
        assert closed == len(socks), f"{len(socks) - closed} idle connections still held"
        w1 = worker(1, addrs, metrics[1], tmp_path / "c")
        outs = [p.communicate(timeout=180) for p in (w0, w1)]
    finally:
        for s in socks:
            s.close()
        for p in (w0,):
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip((w0, w1), outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    final = json.loads(outs[0][0].strip().splitlines()[-1])
    assert final["steps"] == 4 and final["checkpoint"]


def test_the_side_channel_runs_a_bounded_number_of_handshakes_and_still_takes_its_neighbour():
    """The grpc+tcp side channel (ring port + 1) gave every connection a thread and its 5 s
    handshake; now beyond ``links.MAX_HANDSHAKES`` at once a connection is closed on accept."""
    listener = links.Listener(0, 2, 1, "127.0.0.1", fallback=True)
    socks: list[socket.socket] = []
    try:
        for _ in range(100):
            socks.append(socket.create_connection(("127.0.0.1", listener.port), timeout=5))
        handshaking = sum(t.name == "ring-handshake" for t in threading.enumerate())
        closed, _ = closed_within(socks, 2.0)  # the handshakes' own timeout is 5 s
        print(
            json.dumps(
                {
                    "case": "100 idle side-channel connections",
                    "handshake_threads": handshaking,
                    "closed_in_2s": closed,
                }
            )
        )
        assert handshaking <= links.MAX_HANDSHAKES
        assert closed >= len(socks) - links.MAX_HANDSHAKES
        assert listener.refused >= closed
        for s in socks:
            s.close()
        links.connect_with_backoff(f"127.0.0.1:{listener.port}", listener.key, 1, 2, 20).close()
        left = listener.wait_left(10)
        assert left is not None
        left.close()
    finally:
        for s in socks:
            s.close()
        listener.close()
