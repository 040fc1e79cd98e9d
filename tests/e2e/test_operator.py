"""The operator end to end on the real local cluster: CRD applied with kubectl, the server's own
validation, and `ringtrain operator` as a separate process driving real pods to Succeeded."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "operator" / "ringtrain_operator" / "crd" / "trainingjobs.yaml"
OPERATOR_READY_S = 60


def training_job(name: str, image: str, **trainer) -> dict:
    return {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"Worker": {"replicas": 2, "template": {"spec": {
                "terminationGracePeriodSeconds": 5,
                "containers": [{"name": "ringtrain", "image": image,
                                "imagePullPolicy": "Never"}]}}}},
            "trainer": {"dataset": "mnist-5k", "steps": 20, "batchSize": 32, **trainer},
            "runPolicy": {"backoffLimit": 1, "activeDeadlineSeconds": 600},
        },
    }


@pytest.fixture(scope="module")
def crd(kubectl):
    kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.ringtrain.io",
            "--timeout=60s")
    return "trainingjobs.ringtrain.io"


@pytest.fixture
def operator(kubeconfig, namespace, crd, tmp_path):
    """`ringtrain operator` for one namespace, as the Deployment runs it; its log on failure."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", "operator", "--kubeconfig", kubeconfig,
             "-n", namespace, "--listen", f"127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_healthy(port, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(log.read_text()[-6000:])


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + OPERATOR_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"operator exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"operator not healthy after {OPERATOR_READY_S}s:\n{log.read_text()}")


def test_the_server_rejects_what_the_schema_forbids(kubectl, namespace, crd):
    bad = training_job("too-many-chiefs", "ringtrain:0.1.0")
    bad["spec"]["replicaSpecs"]["Chief"] = {"replicas": 2}
    bad["spec"]["trainer"]["optimizer"] = "lamb"
    p = kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert p.returncode != 0
    assert "spec.replicaSpecs.Chief.replicas" in p.stderr
    assert "spec.trainer.optimizer" in p.stderr


def test_the_server_applies_the_crd_defaults(kubectl, namespace, crd):
    job = training_job("defaults", "ringtrain:0.1.0")
    job["spec"]["runPolicy"]["suspend"] = True  # nothing runs: no operator here
    kubectl.apply(job, namespace)
    got = kubectl.json("get", "tj", "defaults", "-n", namespace)["spec"]
    assert got["replicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    assert got["trainer"]["optimizer"] == "adam" and got["trainer"]["ipuMemoryMB"] == 900
    assert got["runPolicy"]["cleanPodPolicy"] == "Running"


def test_a_tiny_training_job_succeeds(kubectl, namespace, operator, project_image):
    kubectl.apply(training_job("tiny", project_image), namespace)
    kubectl("wait", "-n", namespace, "tj/tiny", "--for=jsonpath={.status.state}=Succeeded",
            "--timeout=420s", timeout=450)
    st = kubectl.json("get", "tj", "tiny", "-n", namespace)["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Succeeded"]["status"] == "True"
    assert conds["Created"]["status"] == "True"
    assert st["progress"]["step"] == 20
    assert st["restarts"] == 0
    assert "completionTime" in st and "startTime" in st
    events = kubectl.json("get", "events", "-n", namespace,
                          "--field-selector", "involvedObject.name=tiny")["items"]
    assert {"TrainingJobCreated", "TrainingJobSucceeded"} <= {e["reason"] for e in events}
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", "ringtrain.io/job-name=tiny")
    phases = {p["metadata"]["name"]: p["status"]["phase"] for p in pods["items"]
              if not p["metadata"].get("deletionTimestamp")}
    assert phases.get("tiny-worker-0") == "Succeeded"
    assert "Running" not in phases.values()  # cleanPodPolicy Running


def test_an_invalid_spec_the_schema_accepts_fails_with_reason(kubectl, namespace, operator):
    job = training_job("indivisible", "ringtrain:0.1.0", ipusPerWorker=3)
    kubectl.apply(job, namespace)
    kubectl("wait", "-n", namespace, "tj/indivisible", "--for=jsonpath={.status.state}=Failed",
            "--timeout=60s", timeout=90)
    st = kubectl.json("get", "tj", "indivisible", "-n", namespace)["status"]
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "spec.trainer.batchSize: 32 is not divisible by" in failed["message"]
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", "ringtrain.io/job-name=indivisible")
    assert pods["items"] == []
