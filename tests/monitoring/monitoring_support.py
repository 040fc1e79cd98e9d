"""Real parts for the scrape-path tests: Debian's Prometheus, the chart rendered by helm, pods
rendered by ``ringtrain render``, and the two scrape configurations built from the chart.

Debian builds Prometheus without Kubernetes discovery, so targets reach it through
``file_sd_configs`` carrying exactly the ``__meta_kubernetes_*`` labels that
``kubernetes_sd_configs`` (role: pod) gives — computed by the e2e tier's pod discovery
(``tests/support/pod_discovery.py``) from the rendered Pod objects. The relabel rules are
the chart's, unchanged.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from support import pod_discovery
from support.procs import CLI
from support.prometheus import PROMTOOL, Prometheus, check_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ringtrain"
SNIPPET = CHART / "prometheus" / "scrape-configs.yaml"
RULES = CHART / "rules" / "ringtrain.rules.yaml"
DASHBOARD = CHART / "dashboards" / "ringtrain.json"

# --------------------------------------------------------------------------- objects to scrape


def helm_template(*values: str) -> list[dict]:
    helm = subprocess.run(
        [str(ROOT / "hack" / "tools"), "helm"], check=True, capture_output=True, text=True
    ).stdout.strip()
    out = subprocess.run(
        [helm, "template", "rt", str(CHART), "--namespace", "rt", *values],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_pods(manifest: Path, namespace: str) -> list[dict]:
    """The Pods ``ringtrain render`` prints for the job: what the operator would create."""
    out = subprocess.run(
        [*CLI, "render", str(manifest), "--namespace", namespace],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o and o["kind"] == "Pod"]


def running_on_loopback(pod: dict, metrics_port: int) -> dict:
    """The pod as the API server shows it once running, its metrics port being ``metrics_port``
    (the local process's port stands in for the pod IP's 9400 or 8080)."""
    pod = copy.deepcopy(pod)
    for c in pod["spec"]["containers"]:
        for p in c.get("ports") or []:
            if p.get("name") == "metrics":
                p["containerPort"] = metrics_port
    annotations = pod["metadata"].get("annotations") or {}
    if "prometheus.io/port" in annotations:
        annotations["prometheus.io/port"] = str(metrics_port)
    pod["status"] = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "hostIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    return pod


def operator_pod(deployment: dict, metrics_port: int) -> dict:
    """A pod of the chart's operator Deployment, from its template."""
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "spec": template["spec"],
        "metadata": {
            **template["metadata"],
            "name": deployment["metadata"]["name"] + "-0",
            "namespace": deployment["metadata"]["namespace"],
        },
    }
    return running_on_loopback(pod, metrics_port)


def write_file_sd(path: Path, pods: list[dict]) -> Path:
    path.write_text(json.dumps(pod_discovery.target_groups(pods)))
    return path


# --------------------------------------------------------------------------- scrape configs


def annotation_job(file_sd: list[Path]) -> dict:
    """The chart's annotation scrape job with file SD in place of kubernetes_sd_configs."""
    (job,) = yaml.safe_load(SNIPPET.read_text())
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    return {**job, "file_sd_configs": [{"files": [str(p) for p in file_sd]}]}


def _snake(key: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)


def podmonitor_job(pm: dict, file_sd: list[Path]) -> dict:
    """The scrape job the Prometheus Operator generates for the PodMonitor's first endpoint
    (prometheus-operator pkg/prometheus/promcfg.go: generatePodMonitorConfig): keep the pods the
    selector matches and the named port, set namespace/container/pod/job/endpoint, then the
    PodMonitor's own relabelings."""
    meta = "__meta_kubernetes_pod_"
    ep = pm["spec"]["podMetricsEndpoints"][0]
    name = f"{pm['metadata']['namespace']}/{pm['metadata']['name']}"
    relabel = [{"source_labels": [f"{meta}phase"], "regex": "(Failed|Succeeded)", "action": "drop"}]
    selector = pm["spec"]["selector"]
    for key, value in (selector.get("matchLabels") or {}).items():
        label = pod_discovery.sanitize(key)
        relabel.append(
            {
                "action": "keep",
                "source_labels": [f"{meta}label_{label}", f"{meta}labelpresent_{label}"],
                "regex": f"({value});true",
            }
        )
    for expr in selector.get("matchExpressions") or []:
        label = pod_discovery.sanitize(expr["key"])
        if expr["operator"] == "Exists":
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": [f"{meta}labelpresent_{label}"],
                    "regex": "true",
                }
            )
        elif expr["operator"] == "In":
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": [f"{meta}label_{label}", f"{meta}labelpresent_{label}"],
                    "regex": f"({'|'.join(expr['values'])});true",
                }
            )
        else:
            raise NotImplementedError(expr)
    relabel += [
        {"action": "keep", "source_labels": [f"{meta}container_port_name"], "regex": ep["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": [f"{meta}container_name"], "target_label": "container"},
        {"source_labels": [f"{meta}name"], "target_label": "pod"},
        {"target_label": "job", "replacement": name},
        {"target_label": "endpoint", "replacement": ep["port"]},
    ]
    relabel += [{_snake(k): v for k, v in r.items()} for r in ep.get("relabelings") or []]
    return {
        "job_name": f"podMonitor/{name}/0",
        "honor_labels": False,
        "metrics_path": ep.get("path", "/metrics"),
        "relabel_configs": relabel,
        "file_sd_configs": [{"files": [str(p) for p in file_sd]}],
    }


def prometheus_config(jobs: list[dict], interval_s: float = 1) -> dict:
    return {
        "global": {
            "scrape_interval": f"{interval_s}s",
            "scrape_timeout": f"{interval_s}s",
            "evaluation_interval": f"{interval_s}s",
        },
        "rule_files": [str(RULES)],
        "scrape_configs": jobs,
    }


# --------------------------------------------------------------------------- Prometheus


def start_prometheus(config: dict, workdir: Path) -> Prometheus:
    """Prometheus with ``config`` (checked by promtool first), its files in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    check_config(path)
    return Prometheus(path, workdir)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def promtool_check_metrics(payload: str) -> str:
    """promtool's lint findings on an exposition payload ('' when clean)."""
    out = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=payload, capture_output=True, text=True, timeout=30
    )
    found = (out.stdout + out.stderr).strip()
    return found if out.returncode == 0 else f"{found} (rc={out.returncode})"
