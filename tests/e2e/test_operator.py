"""The operator end to end on the real local cluster: the CRD applied with kubectl, the server's
own validation, defaults and printer columns, and `ringtrain operator` as a separate process
(exactly as the Deployment runs it) driving a 2-worker job over the ring (grpc+tcp data path) to
Succeeded."""

from __future__ import annotations

import json

import pytest
from e2e_support import (
    CRD,
    OperatorProcess,
    job_pods,
    job_story,
    training_job,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def crd(kubectl):
    kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.ringtrain.io", "--timeout=60s")
    return "trainingjobs.ringtrain.io"


@pytest.fixture
def operator(kubeconfig, namespace, crd, tmp_path):
    """`ringtrain operator` for one namespace; its log is printed when the test ends."""
    op = OperatorProcess(kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        print(op.tail(6000))


def test_the_crd_is_structural_and_served_with_status_and_columns(kubectl, crd):
    crd_obj = kubectl.json("get", "crd", crd)
    conds = {c["type"]: c["status"] for c in crd_obj["status"]["conditions"]}
    assert conds.get("Established") == "True"
    assert conds.get("NonStructuralSchema", "False") != "True"
    (version,) = crd_obj["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "State",
        "Workers",
        "Step",
        "Accuracy",
        "Loss",
        "Restarts",
        "Age",
    ]
    short = kubectl("api-resources", "--api-group=ringtrain.io", "-o", "wide").stdout
    assert "tj" in short.split()


def test_the_server_rejects_what_the_schema_forbids(kubectl, namespace, crd):
    bad = training_job("too-many-chiefs", "ringtrain:0.1.0")
    bad["spec"]["replicaSpecs"]["Chief"] = {"replicas": 2}
    bad["spec"]["trainer"]["optimizer"] = "lamb"
    bad["spec"]["runPolicy"]["cleanPodPolicy"] = "Sometimes"
    p = kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert p.returncode != 0
    assert "spec.replicaSpecs.Chief.replicas" in p.stderr
    assert "spec.trainer.optimizer" in p.stderr
    assert "spec.runPolicy.cleanPodPolicy" in p.stderr
    no_worker = training_job("no-worker", "ringtrain:0.1.0")
    del no_worker["spec"]["replicaSpecs"]["Worker"]
    p = kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(no_worker), check=False)
    assert p.returncode != 0 and "Worker" in p.stderr
    assert kubectl.json("get", "tj", "-n", namespace)["items"] == []


def test_the_server_applies_the_crd_defaults(kubectl, namespace, crd):
    job = training_job("defaults", "ringtrain:0.1.0")
    job["spec"]["runPolicy"] = {"suspend": True}  # nothing runs: no operator here
    kubectl.apply(job, namespace)
    got = kubectl.json("get", "tj", "defaults", "-n", namespace)["spec"]
    assert got["replicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    assert got["trainer"]["ipuMemoryMB"] == 900
    assert "optimizer" not in got["trainer"]  # no default: the model's compile settings run
    assert got["runPolicy"] == {
        "suspend": True,
        "backoffLimit": 6,
        "cleanPodPolicy": "Running",
        "successPolicy": "ChiefOrWorker0",
    }


def test_a_two_worker_job_trains_over_the_ring_and_succeeds(
    kubectl, namespace, operator, project_image
):
    # cleanPodPolicy None keeps worker-1, which may still be finishing when the chief's success
    # ends the job (the default, Running, would delete it then, as Kubeflow's TFJob does).
    kubectl.apply(
        training_job("tiny", project_image, steps=20, run_policy={"cleanPodPolicy": "None"}),
        namespace,
    )
    job = wait_state(kubectl, namespace, "tiny", "Succeeded", 300, operator.tail)
    st = job["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Succeeded"]["status"] == "True"
    assert conds["Created"]["status"] == "True"
    assert st["progress"]["step"] == 20
    assert 0.0 < st["progress"]["testAccuracy"] <= 1.0
    assert st["restarts"] == 0 and st["observedGeneration"] == 1
    assert "completionTime" in st and "startTime" in st

    # Both workers ran the ring (a worker exits 0 only if every allreduce completed) and found
    # each other by the TF_CONFIG DNS names of the headless Service.
    def both_done():
        pods = {p["metadata"]["name"]: p for p in job_pods(kubectl, namespace, "tiny")}
        phases = {n: p["status"].get("phase") for n, p in pods.items()}
        return pods if all(ph in ("Succeeded", "Failed") for ph in phases.values()) else None

    pods = wait_for(
        "both workers to exit",
        both_done,
        60,
        lambda: job_story(kubectl, namespace, "tiny", operator.tail),
    )
    assert {n: p["status"]["phase"] for n, p in pods.items()} == {
        "tiny-worker-0": "Succeeded",
        "tiny-worker-1": "Succeeded",
    }
    env = {e["name"]: e.get("value") for e in pods["tiny-worker-1"]["spec"]["containers"][0]["env"]}
    tf = json.loads(env["TF_CONFIG"])
    assert tf["cluster"]["worker"] == [
        f"tiny-worker-{i}.tiny.{namespace}.svc:2222" for i in range(2)
    ]
    assert tf["task"] == {"type": "worker", "index": 1}
    final = json.loads(
        pods["tiny-worker-0"]["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    )
    assert final["steps"] == 20 and final["test_accuracy"] == st["progress"]["testAccuracy"]
    svc = kubectl.json("get", "svc", "tiny", "-n", namespace)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]

    events = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny"
    )["items"]
    reasons = {e["reason"] for e in events}
    assert {"TrainingJobCreated", "TrainingJobSucceeded", "PodCreated"} <= reasons

    table = kubectl("get", "tj", "-n", namespace).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "STATE",
        "WORKERS",
        "STEP",
        "ACCURACY",
        "LOSS",
        "RESTARTS",
        "AGE",
    ]
    row = table[1].split()
    assert row[:4] == ["tiny", "Succeeded", "0/2", "20"] and row[6] == "0"
    assert float(row[4]) == pytest.approx(st["progress"]["testAccuracy"])

    metrics = operator.metrics()
    assert f'ringtrain_operator_jobs_succeeded_total{{job_namespace="{namespace}"}} 1.0' in metrics


@pytest.mark.parametrize("data_path", ["grpc+tcp", "grpc"])
def test_each_data_path_trains_across_pods_with_mutual_tls(
    kubectl, namespace, operator, project_image, data_path
):
    """One job per data path: the gRPC control plane and the tensors cross pods under the job's
    own CA (its Secret holds the CA and certificate), the workers say which path and security
    ran, and they end with identical weights."""
    name = "tls-" + data_path.replace("+", "-")
    kubectl.apply(
        training_job(
            name,
            project_image,
            steps=12,
            ring={"transport": data_path},
            run_policy={"cleanPodPolicy": "None"},
        ),
        namespace,
    )
    wait_state(kubectl, namespace, name, "Succeeded", 300, operator.tail)

    def all_done():
        pods = {p["metadata"]["name"]: p for p in job_pods(kubectl, namespace, name)}
        return (
            pods
            if all(p["status"].get("phase") == "Succeeded" for p in pods.values())
            and len(pods) == 2
            else None
        )

    pods = wait_for(
        "both workers to succeed",
        all_done,
        60,
        lambda: job_story(kubectl, namespace, name, operator.tail),
    )
    secret = kubectl.json("get", "secret", f"{name}-ring-token", "-n", namespace)
    assert {"token", "ca.crt", "tls.crt", "tls.key"} <= set(secret["data"])
    finals = [
        json.loads(p["status"]["containerStatuses"][0]["state"]["terminated"]["message"])
        for p in pods.values()
    ]
    assert [f["steps"] for f in finals] == [12, 12]
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    for pod in pods:
        log = kubectl("logs", pod, "-n", namespace).stdout  # the container's stdout and stderr
        assert f"data path {data_path}, mutual TLS" in log, log[-2000:]


def test_an_invalid_spec_the_schema_accepts_fails_with_reason_and_event(
    kubectl, namespace, operator
):
    kubectl.apply(training_job("indivisible", "ringtrain:0.1.0", ipusPerWorker=3), namespace)
    job = wait_state(
        kubectl, namespace, "indivisible", "Failed", 60, operator.tail, reason="InvalidSpec"
    )
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert "spec.trainer.batchSize: 32 is not divisible by" in failed["message"]
    assert job_pods(kubectl, namespace, "indivisible") == []
    events = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=indivisible"
    )["items"]
    warning = [e for e in events if e["reason"] == "InvalidSpec"]
    assert warning and warning[0]["type"] == "Warning"
    assert "not divisible" in warning[0]["message"]
