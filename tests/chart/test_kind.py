"""The kind path (kind-config.yaml, hack/kind), checked without Docker.

hack/kind runs here against recording stand-ins for docker, kind, kubectl and helm: the test
asserts the commands a user's machine would run, in order, and that the script stops with a
clear message when the job fails. The stand-ins are the only fakes; the files they are handed
(chart, CRD, example, Dockerfile) are the real ones.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml
from chart_helpers import CHART, ROOT

FAKE = """#!/usr/bin/env bash
printf '%s\\n' "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $*" in
  "kind get clusters"*) : ;;
  "kubectl --context kind-ringtrain apply -f "*) echo "trainingjob.ringtrain.io/fashion-mnist" ;;
  "kubectl --context kind-ringtrain get trainingjob.ringtrain.io/fashion-mnist -o jsonpath="*)
      echo -n "$JOB_STATE" ;;
  "kubectl --context kind-ringtrain get trainingjob.ringtrain.io/fashion-mnist --no-headers")
      echo "fashion-mnist   $JOB_STATE   2/2" ;;
esac
exit 0
"""


def test_kind_config_has_a_control_plane_and_two_labelled_workers():
    cfg = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    assert (cfg["kind"], cfg["apiVersion"]) == ("Cluster", "kind.x-k8s.io/v1alpha4")
    roles = [n["role"] for n in cfg["nodes"]]
    assert roles == ["control-plane", "worker", "worker"]
    for n in cfg["nodes"][1:]:
        assert n["labels"] == {"ringtrain.io/pool": "training"}


def run_kind(
    tmp_path: Path, state: str, *args: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("docker", "kind", "kubectl", "helm"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "JOB_STATE": state,
        "JOB_TIMEOUT_S": "30",
    }
    out = subprocess.run(
        [str(ROOT / "hack" / "kind"), *args], env=env, capture_output=True, text=True, timeout=60
    )
    return out, calls.read_text().splitlines() if calls.exists() else []


def test_hack_kind_up_builds_loads_installs_and_waits_for_success(tmp_path):
    out, calls = run_kind(tmp_path, "Succeeded", "up")
    assert out.returncode == 0, out.stderr
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    image = f"ringtrain:{app_version}"
    expected_in_order = [
        "kind create cluster --name ringtrain --config kind-config.yaml --wait 120s",
        f"docker build -t {image} .",
        f"kind load docker-image {image} --name ringtrain",
        "kubectl --context kind-ringtrain apply --server-side -f charts/ringtrain/crds/",
        "helm --kube-context kind-ringtrain upgrade --install ringtrain charts/ringtrain "
        "--namespace ringtrain-system --create-namespace --wait --timeout 5m "
        "--set image.pullPolicy=Never",
        "kubectl --context kind-ringtrain apply -f examples/fashion-mnist-2workers.yaml -o name",
    ]
    positions = [calls.index(c) for c in expected_in_order]
    assert positions == sorted(positions), calls
    assert "TrainingJob fashion-mnist Succeeded" in out.stderr
    assert not any("kube-prometheus-stack" in c for c in calls)  # only with --monitoring
    # The files it hands over exist and the image tag is the one the CRD defaults workers to.
    for path in (
        "kind-config.yaml",
        "charts/ringtrain/crds",
        "examples/fashion-mnist-2workers.yaml",
        "Dockerfile",
    ):
        assert (ROOT / path).exists(), path
    crd = (CHART / "crds" / "trainingjobs.yaml").read_text()
    assert f'default: "{image}"' in crd


def test_hack_kind_up_with_monitoring_installs_the_stack_and_switches_the_chart_on(tmp_path):
    out, calls = run_kind(tmp_path, "Succeeded", "up", "--monitoring")
    # It ends by port-forwarding Grafana (the stand-in returns at once).
    assert out.returncode == 0, out.stderr
    kps = next(c for c in calls if "kube-prometheus-stack" in c)
    assert "podMonitorSelectorNilUsesHelmValues=false" in kps
    chart = next(c for c in calls if "upgrade --install ringtrain" in c)
    for switch in (
        "metrics.serviceMonitor.enabled=true",
        "metrics.podMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "grafana.dashboards.enabled=true",
    ):
        assert switch in chart
    assert calls.index(kps) < calls.index(chart)
    assert calls[-1].startswith(
        "kubectl --context kind-ringtrain -n monitoring port-forward svc/kps-grafana 3000:80"
    )


def test_hack_kind_up_fails_clearly_when_the_job_fails(tmp_path):
    out, calls = run_kind(tmp_path, "Failed", "up")
    assert out.returncode == 1
    assert "TrainingJob fashion-mnist Failed" in out.stderr
    assert any(c.startswith("kubectl --context kind-ringtrain describe") for c in calls)


def test_hack_kind_says_what_is_missing_without_docker(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [str(ROOT / "hack" / "kind"), "up"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert out.stderr.startswith("hack/kind: ")
    assert "is required" in out.stderr or "daemon does not answer" in out.stderr
