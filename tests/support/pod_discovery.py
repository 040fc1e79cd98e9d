"""Kubernetes pod discovery for a Prometheus built without it, over Prometheus' HTTP SD.

Debian's ``prometheus`` package is built without Kubernetes service discovery
(``/usr/share/doc/prometheus/NEWS.Debian.gz``: "Kubernetes support has been completely removed";
``kubernetes_sd_configs`` fails with "field kubernetes_sd_configs not found"). It does have
``http_sd_configs``. This endpoint lists pods from the API server, as whatever identity it is
given (the tests: a ServiceAccount that may only get/list/watch pods) over TLS verified with the
cluster's CA, and answers with one target group per pod container port carrying the very
``__meta_kubernetes_*`` labels that Prometheus' own ``kubernetes_sd_configs`` (role: pod) gives
(``discovery/kubernetes/pod.go``). So the relabel rules written for ``kubernetes_sd_configs``
apply unchanged, and what is tested of them — annotations, ports, the scrape itself — is real
Prometheus.

The difference from the real SD: it lists on every Prometheus refresh (``refresh_interval``)
instead of watching.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

META = "__meta_kubernetes_"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def sanitize(name: str) -> str:
    """Prometheus' strutil.SanitizeLabelName."""
    return _INVALID.sub("_", name)


def _ready(pod: dict) -> str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status", "unknown")).lower()
    return "unknown"


def pod_labels(pod: dict) -> dict[str, str]:
    """The labels every target of the pod shares (pod.go's podLabels plus the namespace)."""
    meta, status = pod["metadata"], pod.get("status", {})
    out = {
        f"{META}namespace": meta.get("namespace", ""),
        f"{META}pod_name": meta["name"],
        f"{META}pod_ip": status.get("podIP", ""),
        f"{META}pod_ready": _ready(pod),
        f"{META}pod_phase": status.get("phase", ""),
        f"{META}pod_node_name": pod.get("spec", {}).get("nodeName", ""),
        f"{META}pod_host_ip": status.get("hostIP", ""),
        f"{META}pod_uid": meta.get("uid", ""),
    }
    controller = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if controller:
        out[f"{META}pod_controller_kind"] = controller["kind"]
        out[f"{META}pod_controller_name"] = controller["name"]
    for key, value in (meta.get("labels") or {}).items():
        out[f"{META}pod_label_{sanitize(key)}"] = value
        out[f"{META}pod_labelpresent_{sanitize(key)}"] = "true"
    for key, value in (meta.get("annotations") or {}).items():
        out[f"{META}pod_annotation_{sanitize(key)}"] = value
        out[f"{META}pod_annotationpresent_{sanitize(key)}"] = "true"
    return out


def target_groups(pods: list[dict]) -> list[dict]:
    """HTTP SD groups: one per container port (a container without ports: one on the pod IP)."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip:  # pod.go: no IP yet, no targets
            continue
        shared = pod_labels(pod)
        spec = pod.get("spec", {})
        for init, containers in (
            (False, spec.get("containers") or []),
            (True, spec.get("initContainers") or []),
        ):
            for c in containers:
                base = {
                    **shared,
                    f"{META}pod_container_name": c["name"],
                    f"{META}pod_container_image": c.get("image", ""),
                    f"{META}pod_container_init": str(init).lower(),
                }
                ports = c.get("ports") or []
                if not ports:
                    groups.append({"targets": [ip], "labels": base})
                for p in ports:
                    number = p["containerPort"]
                    groups.append(
                        {
                            "targets": [f"{ip}:{number}"],
                            "labels": {
                                **base,
                                f"{META}pod_container_port_name": p.get("name", ""),
                                f"{META}pod_container_port_number": str(number),
                                f"{META}pod_container_port_protocol": p.get("protocol", "TCP"),
                            },
                        }
                    )
    return groups


class PodDiscovery:
    """An HTTP SD endpoint (``url``) for the pods of ``namespaces`` of one API server."""

    def __init__(self, api_server: str, ca_file: str, token: str, namespaces: list[str]):
        self.api_server, self.namespaces = api_server.rstrip("/"), namespaces
        self._token = token
        self._tls = ssl.create_default_context(cafile=ca_file)
        self.requests = 0
        self.last_error: str | None = None
        discovery = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                discovery.requests += 1
                try:
                    body, code = json.dumps(discovery.groups()).encode(), 200
                    discovery.last_error = None
                except (OSError, ValueError, KeyError) as e:  # shown by Prometheus as SD error
                    discovery.last_error = f"{type(e).__name__}: {e}"
                    body, code = discovery.last_error.encode(), 502
                self.send_response(code)
                self.send_header(
                    "Content-Type", "application/json" if code == 200 else "text/plain"
                )
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/targets"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name="pod-discovery"
        )

    def list_pods(self, namespace: str) -> list[dict]:
        url = f"{self.api_server}/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods"
        req = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, context=self._tls, timeout=5) as r:
                return json.loads(r.read())["items"]
        except urllib.error.HTTPError as e:
            raise OSError(f"GET {url}: HTTP {e.code}: {e.read()[:500]!r}") from e

    def groups(self) -> list[dict]:
        return target_groups([p for ns in self.namespaces for p in self.list_pods(ns)])

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()
