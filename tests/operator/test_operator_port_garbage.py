"""The operator's one port (/healthz and /metrics, 8080): garbage, oversized, truncated and
idle connections are refused and the server keeps answering (aiohttp, served in process exactly
as ``main.serve`` does)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import urllib.request

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from support.sockets import send_and_drain as send

from ringtrain_operator.main import health_app
from ringtrain_operator.metrics import OperatorMetrics


@pytest.fixture
def port():
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(health_app(OperatorMetrics(CollectorRegistry())))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    bound = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield bound
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def status(answer: bytes) -> bytes:
    return answer[9:12]


def test_garbage_on_the_operator_port_is_refused_and_it_keeps_serving(port):
    """aiohttp logs each refused request at ERROR level; what matters is that it answers."""
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    try:
        for _ in range(3):
            assert status(send(port, os.urandom(4096))) in (b"400", b"")
            assert status(send(port, b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n")) in (
                b"400",
                b"414",
                b"",
            )
            headers = b"".join(b"X-%d: %s\r\n" % (i, b"y" * 1000) for i in range(200))
            assert status(send(port, b"GET /healthz HTTP/1.1\r\n" + headers + b"\r\n")) in (
                b"400",
                b"431",
                b"",
            )
            send(port, b"GET /heal", half_close=True)  # truncated
            assert status(send(port, b"POST /healthz HTTP/1.0\r\n\r\n")) == b"405"
            assert status(send(port, b"GET /../../etc/passwd HTTP/1.0\r\n\r\n")) == b"404"
        for path in ("/healthz", "/metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200
    finally:
        for s in idle:
            s.close()
