"""A chief's ``/status`` is the tenant's code (it chooses the image): the operator's read of it is
bounded in time and bytes, kept off other jobs' reconciles, and a reply that is no status
document is that job's named problem, never a crash (issue 20, item 2).

Every test runs the operator's real fetch (through :func:`reconcile.reconcile` where it is about
the reconcile) against a real HTTP server on loopback that drips, floods or garbles.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime

import pytest
from fake_kube import FakeKube
from operator_jobs import job_obj

from ringtrain_operator import manifests, observe, statusbound
from ringtrain_operator.reconcile import reconcile

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
HEAD = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"


@contextmanager
def serve(reply, host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """A real server on ``host:port``: ``reply(conn, stop)`` answers each connection after its
    request arrived; ``stop`` is set when the test ends (a drip then ends too)."""
    stop = threading.Event()
    lsock = socket.create_server((host, port))

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                reply(conn, stop)
            except OSError:
                pass  # the operator hung up: what it should do to a drip or a flood

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        lsock.close()


def drip(conn: socket.socket, stop: threading.Event) -> None:
    """Headers, then one byte of body every 0.3 s — each read well inside any per-read timeout
    — until the test ends."""
    conn.sendall(HEAD + b"\r\n{")
    while not stop.wait(0.3):
        conn.sendall(b" ")


def body(data: bytes, head: bytes = HEAD):
    def reply(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(data) + data)

    return reply


def call_in_thread(fn, *args, wait_s: float):
    """``fn(*args)`` on a thread: (finished, seconds, result or exception)."""
    box: list = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            box.append(fn(*args))
        except BaseException as e:  # noqa: BLE001  # handed to the test to assert on
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)
    return not t.is_alive(), time.monotonic() - t0, box[0] if box else None


def test_a_dripping_reply_is_cut_at_the_total_deadline(monkeypatch):
    with serve(drip) as port:
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        done, took, got = call_in_thread(observe.fetch_live_status, "127.0.0.1", 1.0, wait_s=8.0)
    print(f'{{"case": "drip", "fetch_s": {took:.3f}}}')
    assert done, "a reply dripping a byte per 0.3 s kept the read going past 8 s"
    assert took < 2.0
    assert "no complete reply within 1 s" in str(got)


def test_a_flooding_reply_is_refused_holding_at_most_the_cap(monkeypatch):
    chunk = b" " * (1 << 20)
    size = 64 << 20

    def flood(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(HEAD + b"Content-Length: %d\r\n\r\n{" % (size + 2))
        for _ in range(size // len(chunk)):
            conn.sendall(chunk)
        conn.sendall(b"}")

    with serve(flood) as port:
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        tracemalloc.start()
        try:
            got = None
            try:
                got = observe.fetch_live_status("127.0.0.1", 10.0)
            except observe.events.StatusRefused as e:
                got = e
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    print(f'{{"case": "flood 64 MiB", "peak_bytes": {peak}}}')
    assert peak < 4 << 20, f"reading a 64 MiB reply held {peak / 2**20:.0f} MiB"
    assert "reply larger than 1048576 bytes" in str(got)


def running_chief(name: str, ip: str) -> FakeKube:
    kube = FakeKube(job_obj(name, workers=2))
    reconcile(kube, "team-a", name, now=T0, fetch=lambda ip: None)
    for i in (0, 1):
        kube.set_pod_phase(f"{name}-worker-{i}", "Running")
        kube.objects[("Pod", f"{name}-worker-{i}")]["status"]["podIP"] = ip
    return kube


GARBLED = {
    "nested 100 000 deep": body(b"[" * 100_000),
    "not JSON": body(b"<html>hello</html>"),
    "a JSON list": body(b"[1, 2]"),
    "HTTP 500": body(b"{}", head=b"HTTP/1.0 500 Oops\r\n"),
    "not HTTP": body(b"", head=b"\x00\xff garbage\r\n"),
}


@pytest.mark.parametrize("case", GARBLED)
def test_a_garbled_reply_is_the_jobs_named_problem_not_a_crash(monkeypatch, caplog, case):
    kube = running_chief("mnist", "127.0.0.1")
    with serve(GARBLED[case]) as port, caplog.at_level(logging.WARNING):
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        decision = reconcile(kube, "team-a", "mnist", now=T0, fetch=observe.fetch_live_status)
    assert decision is not None
    assert "progress" not in kube.job["status"]
    assert "team-a/mnist: mnist-worker-0's /status refused" in caplog.text


@pytest.mark.parametrize(
    "doc,progress",
    [
        (b'{"step": 1' + b"0" * 40 + b', "loss": 0.5}', {"loss": 0.5}),
        (b'{"step": 3, "epoch": 1' + b"0" * 400 + b"}", {"step": 3}),
        (b'{"step": 3, "checkpoint": "' + b"c" * 5000 + b'"}', {"step": 3}),
        (
            b'{"waiting_for": [' + b",".join([b'"w"'] * 100_000) + b"]}",
            {"waitingFor": ["w"] * 64 + ["… 99936 more"], "truncated": ["waitingFor"]},
        ),
        (b'{"ipu_memory": {"kinds": {"weights": 1e999, "grads": ' + b"9" * 30 + b"}}}", {}),
    ],
    ids=[
        "an int no int64 holds",
        "an int no float holds",
        "a 5000-character path",
        "100 000 names",
        "inf and 10^30",
    ],
)
def test_what_the_api_server_would_refuse_never_reaches_the_status(monkeypatch, doc, progress):
    kube = running_chief("mnist", "127.0.0.1")
    with serve(body(doc)) as port:
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        reconcile(kube, "team-a", "mnist", now=T0, fetch=observe.fetch_live_status)
    assert kube.job["status"].get("progress", {}) == progress


def test_six_dripping_chiefs_do_not_delay_another_jobs_reconcile(monkeypatch):
    """The operator reconciles on asyncio's default executor: min(32, CPUs + 4) threads, 6 on
    the 2-core machine that showed it. Six jobs whose chiefs drip took all six; a seventh job
    waited for them (forever, the drip never ending). Each job here has its own chief address
    (127.0.0.2 … 8, one port), as pods have."""
    healthy = body(b'{"step": 7, "loss": 1.5}')
    # the servers stop (ending the drips) before the pool waits for its threads
    with ThreadPoolExecutor(6) as pool, ExitStack() as stack:
        port = stack.enter_context(serve(healthy, "127.0.0.8"))
        for i in range(2, 8):
            stack.enter_context(serve(drip, f"127.0.0.{i}", port))
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        kubes = [running_chief(f"drip{i}", f"127.0.0.{i}") for i in range(2, 8)]
        other = running_chief("other", "127.0.0.8")
        for i, kube in zip(range(2, 8), kubes, strict=True):
            pool.submit(reconcile, kube, "team-a", f"drip{i}", now=T0)
        t0 = time.monotonic()
        fut = pool.submit(reconcile, other, "team-a", "other", now=T0)
        done, took, _ = call_in_thread(fut.result, wait_s=10.0)
        assert done, "the other job's reconcile waited behind six dripping chiefs for 10 s"
    print(f'{{"case": "6 dripping chiefs", "other_reconcile_s": {time.monotonic() - t0:.3f}}}')
    assert took < 2.0
    assert other.job["status"]["progress"] == {"step": 7, "loss": 1.5}


def test_the_poller_reads_on_its_own_threads_and_answers_with_the_last_read_meanwhile():
    release, calls = threading.Event(), []

    def fetch(ip: str):
        calls.append(ip)
        n = len(calls)
        if n == 2:
            release.wait(10)
        if n == 3:
            raise observe.events.StatusRefused("not JSON")
        return {"step": n}

    poll = observe.LiveStatusPoller(fetch, wait_s=0.05, threads=2)
    assert poll("10.0.0.1") == {"step": 1}
    assert poll("10.0.0.1") == {"step": 1}  # read 2 hangs: the last answer, after wait_s
    assert poll("10.0.0.1") == {"step": 1} and calls == ["10.0.0.1"] * 2  # one read in flight
    with pytest.raises(observe.events.StatusRefused):
        poll("10.0.0.2")  # another pod waits for nobody; read 3 is refused, and says so once
    assert poll("10.0.0.2") == {"step": 4}
    release.set()
    assert poll("10.0.0.1") == {"step": 2}


def _kinds(n: int) -> bytes:
    return b",".join(b'"k%06d": 1' % i for i in range(n))


#: /status replies within the reader's 1 MiB cap, each built to bloat what the operator copies
BLOATING = {
    # issue 35: 1.3 MB of status.progress.ipuMemory out of one reply ("k000001Bytes" per kind)
    "80 000 memory kinds": b'{"step": 2, "ipu_memory": {"kinds": {' + _kinds(80_000) + b"}}}",
    "a memory kind named by 1 MB": b'{"ipu_memory": {"kinds": {"' + b"k" * 1_000_000 + b'": 1}}}',
    "80 000 host kinds": b'{"ipu_memory": {"kinds": {}, "host": {' + _kinds(80_000) + b"}}}",
    "memory nested 900 deep": b'{"ipu_memory": {"kinds": '
    + b'{"a": ' * 900
    + b"1"
    + b"}" * 900
    + b"}}",
    "64 names of 16 000 characters": b'{"waiting_for": ['
    + b",".join([b'"' + b"w" * 16_000 + b'"'] * 64)
    + b"]}",
}


@pytest.mark.parametrize("case", BLOATING)
def test_no_reply_bloats_the_status_and_what_is_cut_is_named(monkeypatch, case):
    """Issue 35, item 5: every field the operator copies from a ``/status`` is bounded (count,
    length, depth), and the whole status too: it stays under 64 KiB whatever the reply, the
    reconcile goes on, and ``progress.truncated`` names what was cut for its size."""
    assert len(BLOATING[case]) < observe.events.STATUS_MAX_BYTES
    kube = running_chief("mnist", "127.0.0.1")
    with serve(body(BLOATING[case])) as port:
        monkeypatch.setattr(manifests, "METRICS_PORT", port)
        decision = reconcile(kube, "team-a", "mnist", now=T0, fetch=observe.fetch_live_status)
    written = kube.job["status"]
    print(f'{{"case": "{case}", "status_bytes": {statusbound.size(written)}}}')
    assert decision is not None and written["state"] == "Running"
    assert statusbound.size(written) <= statusbound.STATUS_MAX_BYTES
    progress = written.get("progress", {})
    assert len(progress.get("ipuMemory", {})) <= statusbound.MEMORY_ENTRIES_MAX
    if case != "memory nested 900 deep":  # a malformed report is left out, as before
        assert progress["truncated"] in (["ipuMemory"], ["waitingFor"])


def test_the_next_reply_within_bounds_clears_the_truncation(monkeypatch):
    kube = running_chief("mnist", "127.0.0.1")
    for doc in (BLOATING["80 000 memory kinds"], b'{"step": 3}'):
        with serve(body(doc)) as port:
            monkeypatch.setattr(manifests, "METRICS_PORT", port)
            reconcile(kube, "team-a", "mnist", now=T0, fetch=observe.fetch_live_status)
    assert kube.job["status"]["progress"]["step"] == 3
    assert "truncated" not in kube.job["status"]["progress"]


def test_the_whole_status_is_bounded_for_a_field_added_without_its_bound():
    """The backstop: a status that a future field (or a 1 MB condition message) makes large is
    cut to the bound, the worker parts to their numbers, and what went is named."""
    huge = {
        "state": "Running",
        "conditions": [{"type": "Running", "status": "True", "message": "m" * 1_000_000}],
        "progress": {"step": 5, "loss": 0.5, "future": ["x" * 1000] * 1000},
        "evaluation": {"step": 4, "testAccuracy": 0.9, "checkpoint": "/c" * 10},
    }
    out = statusbound.bounded(huge)
    assert statusbound.size(out) <= statusbound.STATUS_MAX_BYTES
    assert len(out["conditions"][0]["message"]) == statusbound.MESSAGE_MAX
    assert out["progress"] == {"step": 5, "loss": 0.5, "truncated": ["future"]}
    assert out["evaluation"] == {"step": 4, "testAccuracy": 0.9, "truncated": ["checkpoint"]}
    small = {"state": "Running", "progress": {"step": 1, "checkpoint": "/c"}}
    assert statusbound.bounded(small) == small
