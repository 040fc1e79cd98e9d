"""The Helm chart on the real cluster: `helm install` runs the operator in-cluster as a
Deployment from the image built from the project's Dockerfile, with the chart's least-privilege
RBAC, and a 2-worker TrainingJob then trains over the ring (grpc+tcp data path) to Succeeded."""

from __future__ import annotations

import json
import urllib.request

import pytest
from e2e_support import job_pods, training_job, wait_for, wait_state

pytestmark = pytest.mark.e2e


def operator_log(kubectl, namespace):
    def log() -> str:
        p = kubectl("logs", "-n", namespace, "deploy/rt-ringtrain", "--tail", "80", check=False)
        return p.stdout + p.stderr

    return log


def test_the_chart_runs_the_operator_in_cluster_with_least_privilege(
    kubectl, namespace, operator_release
):
    dep = kubectl.json("get", "deployment", operator_release.deployment, "-n", namespace)
    assert dep["status"].get("availableReplicas") == 1
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == operator_release.service_account
    assert spec["containers"][0]["args"][:2] == ["operator", f"--namespace={namespace}"]
    assert spec["securityContext"]["runAsNonRoot"] is True

    # RBAC as the API server enforces it for the operator's ServiceAccount.
    who = f"system:serviceaccount:{namespace}:{operator_release.service_account}"

    def can(*args: str) -> bool:
        p = kubectl("auth", "can-i", "--as", who, *args, check=False)
        return p.stdout.strip() == "yes"

    assert can("create", "pods", "-n", namespace)
    assert can("patch", "trainingjobs.ringtrain.io", "--subresource=status", "-n", namespace)
    assert can("create", "secrets", "-n", namespace)
    # a Secret is read only by name, when a create met one (409), to check that its controller
    # is the job (decision 0202); never listed or watched
    assert can("get", "secrets", "-n", namespace)
    assert not can("list", "secrets", "-n", namespace)
    assert not can("watch", "secrets", "-n", namespace)
    assert not can("create", "pods", "-n", "default")  # only its own namespace
    assert not can("list", "namespaces")
    assert not can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can("delete", "nodes")
    assert not can("create", "pods", "--subresource=exec", "-n", namespace)
    assert not can("update", "trainingjobs.ringtrain.io", "-n", namespace)

    # Namespaced mode does not even try cluster-wide scans (no 403 retries in its log).
    log = operator_log(kubectl, namespace)()
    assert "Forbidden" not in log, log


def test_a_two_worker_job_succeeds_under_the_in_cluster_operator(
    kubectl, namespace, operator_release, project_image
):
    # cleanPodPolicy None: keep worker-1 even if it is still finishing when the chief's success
    # ends the job (the default, Running, deletes it then).
    kubectl.apply(
        training_job("chart-job", project_image, steps=20, run_policy={"cleanPodPolicy": "None"}),
        namespace,
    )
    job = wait_state(
        kubectl, namespace, "chart-job", "Succeeded", 300, operator_log(kubectl, namespace)
    )
    st = job["status"]
    assert st["progress"]["step"] == 20 and 0.0 < st["progress"]["testAccuracy"] <= 1.0

    def both_exited():
        phases = {
            p["metadata"]["name"]: p["status"].get("phase")
            for p in job_pods(kubectl, namespace, "chart-job")
        }
        return phases if all(ph in ("Succeeded", "Failed") for ph in phases.values()) else None

    phases = wait_for("both workers to exit", both_exited, 60, operator_log(kubectl, namespace))
    assert phases == {"chart-job-worker-0": "Succeeded", "chart-job-worker-1": "Succeeded"}
    tf = json.loads(
        next(
            e["value"]
            for e in kubectl.json("get", "pod", "chart-job-worker-0", "-n", namespace)["spec"][
                "containers"
            ][0]["env"]
            if e["name"] == "TF_CONFIG"
        )
    )
    assert tf["cluster"]["worker"][1] == f"chart-job-worker-1.chart-job.{namespace}.svc:2222"

    # The operator's own metrics, straight from its pod (the chart's metrics port).
    (pod,) = kubectl.json("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/name=ringtrain")[
        "items"
    ]

    def scraped():
        url = f"http://{pod['status']['podIP']}:8080/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return (
            text
            if f'ringtrain_operator_jobs_succeeded_total{{job_namespace="{namespace}"}} 1.0' in text
            else None
        )

    wait_for(
        "the operator's metrics to count the success", scraped, 30, operator_log(kubectl, namespace)
    )
