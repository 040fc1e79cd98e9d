"""Debian's Prometheus as a child process on a free loopback port, asked through its HTTP API:
the scrape-path tests (tests/monitoring, targets from files) and the e2e tier's (targets from
the cluster) run the same server the same way.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support import procs
from support.ports import free_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def check_config(path: Path) -> None:
    """``promtool check config``: a configuration Prometheus would refuse fails the test here,
    with promtool's reasons and the file, rather than as a server that never gets ready."""
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, (
        f"promtool check config failed (rc={out.returncode}):\n{out.stdout}{out.stderr}\n"
        f"{path.read_text()}"
    )


class Prometheus:
    """Prometheus with ``config``, its TSDB and log in ``workdir``; ``flags`` are added to its
    command line."""

    def __init__(self, config: Path, workdir: Path, *flags: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )

    def get(self, path: str, **params: Any) -> Any:
        """The ``data`` of an API answer (which must be a success)."""
        query = f"?{urllib.parse.urlencode(params, doseq=True)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as r:
            body = json.loads(r.read())
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's vector: [{"metric": {...}, "value": float}]."""
        data = self.get("/api/v1/query", query=promql)
        assert data["resultType"] == "vector", (promql, data)
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def until(self, what: str, check: Callable[[], Any], deadline: float, poll_s: float = 0.5):
        """Poll ``check`` (None: not yet) until the deadline; fail with Prometheus' log."""
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                last = check()
            except (OSError, ValueError) as e:  # not ready yet, an API hiccup: poll again
                last = e
            if last is not None and not isinstance(last, Exception):
                return last
            time.sleep(poll_s)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{self.tail()}")

    def wait_ready(self, timeout_s: float = 30) -> None:
        def ready():
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return True if r.status == 200 else None

        self.until("prometheus to be ready", ready, time.monotonic() + timeout_s, poll_s=0.1)

    def targets_json(self) -> str:
        try:
            return json.dumps(self.get("/api/v1/targets"), indent=1)[-8000:]
        except (OSError, AssertionError, ValueError) as e:
            return f"(no /api/v1/targets: {e})"

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no prometheus log: {e})"

    def stop(self) -> None:
        procs.stop(self.proc)
