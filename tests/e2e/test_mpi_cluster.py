"""MPI jobs (spec.mpi) end to end on the real local cluster (issue 21): `ringtrain operator` as a
separate process creates the SSH Secret, the hostfile, two workers running sshd and, once their
sshd answers, the launcher, whose real `mpirun` starts the ranks in the workers over ssh.

RINGTRAIN_E2E_MPI_IMAGE names an image already imported into the cluster (hack/build-image
TAG) instead of building the project's own (the shared cluster's tag stays untouched)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from e2e_support import CRD, OperatorProcess, get_job, wait_for, wait_state

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LABEL = "ringtrain.io/job-name"


@pytest.fixture
def image(request) -> str:
    return os.environ.get("RINGTRAIN_E2E_MPI_IMAGE") or request.getfixturevalue("project_image")


@pytest.fixture
def operator(kubeconfig, namespace, kubectl, tmp_path):
    kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.ringtrain.io", "--timeout=60s")
    op = OperatorProcess(kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        print(op.tail(6000))


def with_image(doc: dict, image: str) -> dict:
    """The example, its pods on ``image`` (never pulled: the cluster has no registry)."""
    doc = json.loads(json.dumps(doc))
    spec = doc["spec"]
    if "trainer" in spec:
        spec["trainer"]["image"] = image
    for key in ("Launcher", "Worker"):
        rs = spec["replicaSpecs"].setdefault(key, {})
        pod = rs.setdefault("template", {}).setdefault("spec", {})
        containers = pod.setdefault("containers", [{"name": "ringtrain"}])
        for c in containers:
            c.update(image=image, imagePullPolicy="Never")
            c.setdefault("resources", {"requests": {"cpu": "10m"}})
        pod["terminationGracePeriodSeconds"] = 5
    spec.setdefault("runPolicy", {}).update(activeDeadlineSeconds=600)
    return doc


def apply(kubectl, doc: dict, ns: str) -> None:
    """Apply once the API server's OpenAPI knows spec.mpi: it is published a few seconds after
    the CRD changes, and kubectl validates against it (another session's CRD apply may also
    have just replaced it, so the fixture's apply is repeated)."""

    def applied() -> bool:
        kubectl("apply", "-f", str(CRD))
        body = json.dumps(doc)
        return kubectl("apply", "-n", ns, "-f", "-", input=body, check=False).returncode == 0

    wait_for("the TrainingJob with spec.mpi to be accepted", applied, 90, lambda: "")


def owned(kubectl, ns: str, name: str) -> dict[str, list[str]]:
    out = {}
    for kind in ("pods", "secrets", "configmaps", "services"):
        items = kubectl.json("get", kind, "-n", ns, "-l", f"{LABEL}={name}")["items"]
        out[kind] = sorted(o["metadata"]["name"] for o in items)
    return out


def test_a_two_worker_mpi_job_succeeds_and_deleting_it_leaves_nothing(
    kubectl, namespace, operator, image
):
    doc = with_image(yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text()), image)
    name = doc["metadata"]["name"]
    apply(kubectl, doc, namespace)
    job = wait_state(kubectl, namespace, name, "Succeeded", 420, operator.tail)
    st = job["status"]
    assert st["progress"]["step"] == doc["spec"]["trainer"]["steps"]
    assert st["restarts"] == 0
    launcher = kubectl.json("get", "pod", f"{name}-launcher", "-n", namespace)
    assert launcher["status"]["phase"] == "Succeeded"
    children = owned(kubectl, namespace, name)
    assert children["secrets"] == [f"{name}-ssh"] and children["configmaps"] == [f"{name}-mpi"]
    # no key in status, Events or the launcher's log
    secret = kubectl.json("get", "secret", f"{name}-ssh", "-n", namespace)
    key = secret["data"]["ssh-privatekey"]
    events = kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    logs = kubectl("logs", "-n", namespace, f"{name}-launcher").stdout
    assert key not in json.dumps(st) + events + logs
    assert "PRIVATE KEY" not in events + logs

    kubectl("delete", "tj", name, "-n", namespace, "--wait=true")
    wait_for(
        "the garbage collector to delete the job's pods, Secret, ConfigMap and Service",
        lambda: not any(owned(kubectl, namespace, name).values()),
        180,
        lambda: json.dumps(owned(kubectl, namespace, name)),
    )
    assert get_job(kubectl, namespace, name) is None


def test_a_stock_mpi4py_script_job_succeeds(kubectl, namespace, operator, image):
    doc = with_image(yaml.safe_load((EXAMPLES / "mpi4py-allreduce.yaml").read_text()), image)
    name = doc["metadata"]["name"]
    apply(kubectl, doc, namespace)
    wait_state(kubectl, namespace, name, "Succeeded", 300, operator.tail)
    logs = kubectl("logs", "-n", namespace, f"{name}-launcher").stdout
    for rank in range(4):
        assert f"rank {rank}/4:" in logs, logs
    assert "WRONG" not in logs
