"""The worker's HTTP server: ``/metrics`` for Prometheus, ``/status`` for people and the operator.

Why bounded: the port is reachable from the pod network, so a slow or idle client must not hold
a thread forever nor many clients exhaust them (:data:`IDLE_TIMEOUT_S`, :data:`MAX_CONNECTIONS`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ringtrain_trainer.telemetry.metrics import TrainerMetrics

#: A connection that sends no complete request for this long is closed, so idle or trickling
#: clients cannot pin the server's threads (a scrape takes milliseconds).
IDLE_TIMEOUT_S = 10.0


#: Connections served at once (a thread and a descriptor each, for up to IDLE_TIMEOUT_S); one
#: more is closed as it is accepted. Unbounded, 2,000 idle connections to a worker's metrics
#: port held 2,000 of both and, at the common 1024 open-files limit, failed the chief's next
#: checkpoint write (issue 20).
MAX_CONNECTIONS = 32


class _BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    #: socketserver's default backlog of 5 dropped the SYN of a scrape arriving among a flood
    #: (retried by the client only after 1 s, then 3 s...); refusals are the server's job
    request_queue_size = 512

    def __init__(self, address, handler) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0

    def verify_request(self, request, client_address) -> bool:
        if self._slots.acquire(blocking=False):
            return True
        self.refused += 1  # socketserver closes it
        return False

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """``/metrics`` (Prometheus text) and ``/status`` (JSON) on ``port`` (0: any free port)."""

    def __init__(self, metrics: TrainerMetrics, port: int, host: str = "0.0.0.0"):
        m = metrics

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT_S

            def do_GET(self):
                if self.path.split("?")[0] == "/metrics":
                    body, ctype = generate_latest(m.registry), CONTENT_TYPE_LATEST
                elif self.path.split("?")[0] == "/status":
                    body, ctype = json.dumps(m.status()).encode(), "application/json"
                else:
                    self.send_error(404, "try /metrics or /status")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = _BoundedHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="ringtrain-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()
