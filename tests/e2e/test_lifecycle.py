"""The TrainingJob lifecycle through real pods on the real cluster, with `ringtrain operator` as a
separate local process (exactly as the Deployment runs it): a killed worker container restarts
in place with its peers, the chief resuming from its own emptyDir checkpoint;
activeDeadlineSeconds with cleanPodPolicy, suspend/resume, garbage collection on delete, and
kill -9 of the operator mid-job."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from e2e_support import (
    OperatorProcess,
    fresh_namespace,
    get_job,
    job_pods,
    newest_checkpoint_step,
    sleep_job,
    training_job,
    wait_for,
    wait_state,
)
from fault_support import REJOINED, events, story

pytestmark = pytest.mark.e2e

CTR_SOCK = "/run/ringtrain-containerd/containerd.sock"


@pytest.fixture(scope="module")
def ns(kubectl):
    with fresh_namespace(kubectl, "e2e-lifecycle") as name:
        yield name


@pytest.fixture(scope="module")
def operator(kubeconfig, ns, tmp_path_factory):
    op = OperatorProcess(kubeconfig, [ns], tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(op.tail(8000))


def pods_gone(kubectl, ns, name):
    return lambda: job_pods(kubectl, ns, name) == []


def pods_deleted(kubectl, ns, name):
    """No pod of the job left that is not being deleted: the operator has deleted them all.
    (The test cluster's kubelet once kept two such pods Terminating for over a minute: killed,
    then restarted by the kubelet while the deletion was pending, they were "ContainerCreating"
    when it looked for them; that is the node's business, not the operator's.)"""
    return lambda: job_pods(kubectl, ns, name, include_deleting=False) == []


def all_running(kubectl, ns, name, n):
    def check():
        pods = job_pods(kubectl, ns, name, include_deleting=False)
        return len(pods) == n and all(p["status"].get("phase") == "Running" for p in pods)

    return check


def test_a_killed_worker_restarts_in_place_and_resumes_from_the_default_emptydir(
    kubectl, ns, operator, project_image
):
    """The default checkpoint volume (an emptyDir, no storage to set up): a SIGKILLed worker
    is restarted by its kubelet in its own pod, the chief leaves the broken ring and rejoins it
    in its own container (a re-exec, no restart), and resumes from its own emptyDir; no pod is
    recreated, one restart is counted."""
    name = "killed"
    # Long enough (tens of seconds on two cores) that the kill lands mid-run, not after the end.
    # cleanPodPolicy None: worker-1 must still exist after the chief's success ends the job.
    job = training_job(
        name,
        project_image,
        steps=1500,
        run_policy={"cleanPodPolicy": "None", "backoffLimit": 6},
        checkpoint={"everySteps": 20},
    )
    assert "volume" not in job["spec"]["trainer"]["checkpoint"]
    kubectl.apply(job, ns)
    chief = f"{name}-worker-0"
    wait_for(
        "both pods running",
        all_running(kubectl, ns, name, 2),
        180,
        story(kubectl, ns, name, operator),
    )
    # Mid-run: the chief's first checkpoint is in its emptyDir, training goes on.
    killed_at = wait_for(
        "the first checkpoint",
        lambda: newest_checkpoint_step(kubectl, ns, chief),
        180,
        story(kubectl, ns, name, operator),
        poll_s=0.2,
    )
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    victim = kubectl.json("get", "pod", f"{name}-worker-1", "-n", ns)
    cid = victim["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    # SIGKILL from the node, as the OOM killer would: exit 137, retryable under ExitCode.
    subprocess.run(
        ["ctr", "--address", CTR_SOCK, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", cid],
        check=True,
        capture_output=True,
        timeout=30,
    )

    # Restarting may last less than one poll: the events keep the transition.
    done = wait_state(kubectl, ns, name, "Succeeded", 300, operator.tail)
    st = done["status"]
    assert st["progress"]["step"] == 1500
    assert killed_at >= 20 and killed_at < 1500
    # The same pods: restarted in place, none recreated.
    after = {p["metadata"]["name"]: p for p in job_pods(kubectl, ns, name)}
    assert {n: p["metadata"]["uid"] for n, p in after.items()} == before
    cs = {n: p["status"]["containerStatuses"][0] for n, p in after.items()}
    assert cs[f"{name}-worker-1"]["restartCount"] == 1
    assert cs[chief]["restartCount"] == 0, "the chief rejoined in its container"
    # The one container restart counts; no pod replacement happened.
    assert st["restarts"] == 1
    assert st.get("gangRestarts", 0) == 0
    # The rejoined chief resumed from its own emptyDir's checkpoint instead of starting over.
    log = kubectl("logs", chief, "-n", ns, "-c", "ringtrain").stdout
    assert log.count(REJOINED) == 1, log[-3000:]
    progress = [
        json.loads(line)
        for line in log.split(REJOINED)[-1].splitlines()
        if line.startswith("{") and '"progress"' in line
    ]
    assert progress and progress[0]["step"] > killed_at, log[-3000:]
    evs = events(kubectl, ns, name)
    restarting = [e["message"] for e in evs if e["reason"] == "TrainingJobRestarting"]
    assert restarting and all(
        "restarting in place, its peers rejoin the ring" in m for m in restarting
    ), restarting
    assert any(f"pod {name}-worker-1 failed with exit code 137" in m for m in restarting), (
        restarting
    )
    reasons = [e["reason"] for e in evs]
    assert "TrainingJobSucceeded" in reasons
    assert "PodDeleted" not in reasons
    assert sum(e.get("count", 1) for e in evs if e["reason"] == "PodCreated") == 2
    print(
        f"killed after checkpoint step {killed_at}; the rejoined chief's first step "
        f"{progress[0]['step']}; restarts {st['restarts']}; Restarting events: {restarting}"
    )


def test_a_deleted_chief_pod_is_recreated_alone_and_resumes_from_a_volume_that_outlives_it(
    kubectl, ns, operator, project_image
):
    """Pod loss is what an emptyDir does not survive: the chief's pod is deleted by hand, the
    operator recreates that pod alone, worker-1 restarts or rejoins in place, and the new chief
    resumes from the checkpoint volume that outlives pods (hostPath here, as a PVC on a real
    cluster)."""
    name = "podloss"
    ckpt = Path(f"/tmp/ringtrain-e2e/{ns}/{name}")
    ckpt.mkdir(parents=True, exist_ok=True)
    ckpt.chmod(0o777)
    job = training_job(
        name,
        project_image,
        steps=1500,
        run_policy={"cleanPodPolicy": "None", "backoffLimit": 6},
        checkpoint={
            "everySteps": 20,
            "volume": {"hostPath": {"path": str(ckpt), "type": "Directory"}},
        },
    )
    kubectl.apply(job, ns)
    chief = f"{name}-worker-0"
    try:
        wait_for(
            "the first checkpoint",
            lambda: any(ckpt.glob("ckpt-*.json")),
            180,
            story(kubectl, ns, name, operator),
            poll_s=0.2,
        )
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
        deleted_at = max(json.loads(f.read_text())["step"] for f in ckpt.glob("ckpt-*.json"))
        kubectl("delete", "pod", chief, "-n", ns, "--wait=false")
        done = wait_state(kubectl, ns, name, "Succeeded", 300, operator.tail)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    st = done["status"]
    assert st["progress"]["step"] == 1500
    after = {p["metadata"]["name"]: p for p in job_pods(kubectl, ns, name)}
    assert after[chief]["metadata"]["uid"] != before[chief], "the chief's pod was recreated"
    worker1 = after[f"{name}-worker-1"]
    assert worker1["metadata"]["uid"] == before[f"{name}-worker-1"], "worker-1 was not"
    w1 = worker1["status"]["containerStatuses"][0]
    # SIGTERM to the chief is a stop vote: the gang checkpoints at one step and exits 143 (a
    # peer that lost the ring first instead rejoins it in its container).
    w1_log = kubectl("logs", f"{name}-worker-1", "-n", ns, "-c", "ringtrain").stdout
    how = (
        f"exited {w1['lastState']['terminated']['exitCode']}"
        if w1["restartCount"]
        else f"rejoined {w1_log.count(REJOINED)} time(s)"
    )
    assert how in ("exited 143", "rejoined 1 time(s)"), how
    # The deletion itself is not a restart the job made; worker-1's restart in place is.
    assert (
        st["restarts"]
        == w1["restartCount"] + after[chief]["status"]["containerStatuses"][0]["restartCount"]
        and st.get("gangRestarts", 0) == 0
    )
    log = kubectl("logs", chief, "-n", ns, "-c", "ringtrain").stdout
    progress = [
        json.loads(line)
        for line in log.splitlines()
        if line.startswith("{") and '"progress"' in line
    ]
    assert progress and progress[0]["step"] > deleted_at >= 20, log[-3000:]
    evs = events(kubectl, ns, name)
    assert sum(e.get("count", 1) for e in evs if e["reason"] == "PodCreated") == 3
    assert "TrainingJobSucceeded" in [e["reason"] for e in evs]
    print(
        f"chief deleted after checkpoint step {deleted_at}; the recreated chief's first step "
        f"{progress[0]['step']}; worker-1 {how}; "
        f"restarts {st['restarts']}"
    )


def test_active_deadline_fails_the_job_and_applies_clean_pod_policy(
    kubectl, ns, operator, project_image
):
    name = "deadline"
    kubectl.apply(
        sleep_job(
            name,
            project_image,
            run_policy={"activeDeadlineSeconds": 8, "cleanPodPolicy": "Running"},
        ),
        ns,
    )
    wait_for(
        "both pods running",
        all_running(kubectl, ns, name, 2),
        60,
        story(kubectl, ns, name, operator),
    )
    job = wait_state(kubectl, ns, name, "Failed", 60, operator.tail, reason="DeadlineExceeded")
    st = job["status"]
    elapsed = (
        datetime.strptime(st["completionTime"], "%Y-%m-%dT%H:%M:%SZ")
        - datetime.strptime(st["startTime"], "%Y-%m-%dT%H:%M:%SZ")
    ).total_seconds()
    assert 8 <= elapsed <= 12  # the daemon wakes at the deadline, not at some resync
    wait_for(
        "cleanPodPolicy Running to delete the running pods",
        pods_deleted(kubectl, ns, name),
        60,
        story(kubectl, ns, name, operator),
    )
    ev = [e for e in events(kubectl, ns, name) if e["reason"] == "DeadlineExceeded"]
    assert ev and ev[0]["type"] == "Warning"


def test_suspend_deletes_the_pods_and_resume_recreates_them(kubectl, ns, operator, project_image):
    name = "suspend"
    kubectl.apply(sleep_job(name, project_image, run_policy={"activeDeadlineSeconds": 600}), ns)
    wait_for(
        "both pods running",
        all_running(kubectl, ns, name, 2),
        60,
        story(kubectl, ns, name, operator),
    )
    first = get_job(kubectl, ns, name)["status"]["startTime"]
    old_uids = {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}

    kubectl(
        "patch",
        "tj",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"suspend":true}}}',
    )
    wait_state(kubectl, ns, name, "Suspended", 30, operator.tail)
    wait_for(
        "the suspended job's pods to be deleted",
        pods_gone(kubectl, ns, name),
        60,
        story(kubectl, ns, name, operator),
    )
    # startTime has 1 s resolution; creation, start and suspension above took longer than that.
    resumed_at = datetime.now(UTC).replace(microsecond=0)
    kubectl(
        "patch",
        "tj",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"suspend":false}}}',
    )
    wait_for(
        "both pods running again",
        all_running(kubectl, ns, name, 2),
        60,
        story(kubectl, ns, name, operator),
    )
    job = wait_state(kubectl, ns, name, "Running", 30, operator.tail)
    st = job["status"]
    assert {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}.isdisjoint(old_uids)
    restarted = datetime.strptime(st["startTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert st["startTime"] != first and restarted >= resumed_at
    suspended = next(c for c in st["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "False" and suspended["reason"] == "TrainingJobResumed"
    reasons = {e["reason"] for e in events(kubectl, ns, name)}
    assert {"TrainingJobSuspended", "TrainingJobResumed"} <= reasons


def test_deleting_the_job_garbage_collects_pods_service_and_secret(
    kubectl, ns, operator, project_image
):
    name = "gc"
    kubectl.apply(sleep_job(name, project_image), ns)
    wait_for(
        "both pods running",
        all_running(kubectl, ns, name, 2),
        60,
        story(kubectl, ns, name, operator),
    )
    assert kubectl("get", "svc", name, "-n", ns, check=False).returncode == 0
    assert kubectl("get", "secret", f"{name}-ring-token", "-n", ns, check=False).returncode == 0
    kubectl("delete", "tj", name, "-n", ns, "--wait=false")

    def everything_gone():
        left = kubectl("get", "pods,svc,secrets,tj", "-n", ns, "-o", "name", check=False).stdout
        return not any(f"/{name}" in line for line in left.split())

    wait_for(
        "the TrainingJob and its pods, Service and Secret to be gone",
        everything_gone,
        90,
        lambda: kubectl("get", "all,secrets,tj", "-n", ns, "-o", "wide").stdout + operator.tail(),
    )


def test_kill_9_of_the_operator_mid_job_duplicates_nothing_and_the_job_finishes(
    kubectl, ns, operator, project_image
):
    name = "kill9"
    kubectl.apply(
        training_job(name, project_image, steps=60, run_policy={"cleanPodPolicy": "None"}), ns
    )
    wait_state(kubectl, ns, name, "Running", 120, operator.tail)
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    assert sorted(before) == [f"{name}-worker-0", f"{name}-worker-1"]
    operator.kill9()
    operator.start()
    done = wait_state(kubectl, ns, name, "Succeeded", 300, operator.tail)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    assert after == before  # the same two pods: nothing recreated, nothing duplicated
    assert done["status"]["restarts"] == 0 and done["status"]["progress"]["step"] == 60
    created = [e for e in events(kubectl, ns, name) if e["reason"] == "PodCreated"]
    assert sum(e.get("count", 1) for e in created) == 2
