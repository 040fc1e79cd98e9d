"""MPI jobs (spec.mpi) end to end on the real local cluster (issue 21): `ringtrain operator` as a
separate process creates the SSH Secret, the hostfile, two workers running sshd and, once their
sshd answers, the launcher, whose real `mpirun` starts the ranks in the workers over ssh.

Where rank 0's checkpoint lives (README, decisions): on worker 0's checkpoint volume. A killed
rank fails mpirun and the launcher restarts in place, but no worker pod is replaced (their
sshd never stopped), so the default emptyDir on worker 0 is what the restarted ranks resume
from; only the loss of worker 0's pod needs spec.trainer.checkpoint.volume (a PVC). The
weights test puts both jobs' checkpoints in host directories only so that it can read them.

RINGTRAIN_E2E_MPI_IMAGE names an image already imported into the cluster (hack/build-image
TAG) instead of building the project's own (the shared cluster's tag stays untouched)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from e2e_support import (
    CRD,
    get_job,
    job_story,
    newest_checkpoint_step,
    wait_for,
    wait_state,
)
from fault_support import ExitRecorder, ckpt_dir, container_id, events, final_weights, host_pids

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LABEL = "ringtrain.io/job-name"


@pytest.fixture
def image(request) -> str:
    return os.environ.get("RINGTRAIN_E2E_MPI_IMAGE") or request.getfixturevalue("project_image")


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


def launcher_story(kubectl, ns: str, name: str) -> str:
    """The launcher's termination message and the end of its log: where rank 0's result is."""
    pod = kubectl.json("get", "pod", f"{name}-launcher", "-n", ns)
    states = [c.get("state") for c in pod["status"].get("containerStatuses", [])]
    log = kubectl("logs", "-n", ns, f"{name}-launcher", check=False).stdout
    return f"launcher states: {json.dumps(states)}\nlauncher log (end):\n{log[-4000:]}"


def test_a_two_worker_mpi_job_succeeds_and_deleting_it_leaves_nothing(
    kubectl, namespace, operator, image
):
    doc = with_image(yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text()), image)
    name = doc["metadata"]["name"]
    apply(kubectl, doc, namespace)
    job = wait_state(kubectl, namespace, name, "Succeeded", 420, operator.tail)
    st = job["status"]
    assert st["progress"]["step"] == doc["spec"]["trainer"]["steps"], launcher_story(
        kubectl, namespace, name
    )
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
    said = json.dumps(st) + events + logs + operator.tail(1_000_000)
    assert key not in said and "PRIVATE KEY" not in said
    assert "BEGIN OPENSSH" not in said

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


def example(image: str, name: str, **trainer) -> dict:
    doc = with_image(yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text()), image)
    doc["metadata"]["name"] = name
    doc["spec"]["trainer"].update(trainer)
    return doc


def as_ring(doc: dict) -> dict:
    """The same job as a ring job: no spec.mpi, no Launcher (what README's table compares)."""
    doc["spec"].pop("mpi")
    del doc["spec"]["replicaSpecs"]["Launcher"]
    return doc


def host_checkpoints(ns: str, name: str) -> tuple[Path, dict]:
    """A host directory for the job's checkpoint volume (hostPath: the node is this machine)."""
    path = ckpt_dir(ns, name)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path, {"hostPath": {"path": str(path), "type": "Directory"}}


WEIGHT_STEPS, WEIGHT_EVERY = 300, 100


def test_on_the_cluster_the_mpi_jobs_final_weights_equal_the_ring_jobs(
    kubectl, namespace, operator, image
):
    """The example's job (seed 7, 300 steps, 2 workers, batch 32 each) as a ring job, then as
    an MPI job: rank 0's final checkpoint equals the ring chief's, array by array."""
    runs = {}
    for kind in ("ring", "mpi"):
        name = f"{kind}-weights"
        path, volume = host_checkpoints(namespace, name)
        checkpoint = {"everySteps": WEIGHT_EVERY, "volume": volume}
        doc = example(image, name, steps=WEIGHT_STEPS, checkpoint=checkpoint)
        if kind == "ring":
            doc = as_ring(doc)
        apply(kubectl, doc, namespace)
        job = wait_state(kubectl, namespace, name, "Succeeded", 420, operator.tail)
        st = job["status"]
        assert st["restarts"] == 0, st
        story = launcher_story(kubectl, namespace, name) if kind == "mpi" else st
        assert st["progress"]["step"] == WEIGHT_STEPS, story
        runs[kind] = (st, final_weights(path, WEIGHT_STEPS))
    ring, by_mpi = runs["ring"][1], runs["mpi"][1]
    assert sorted(by_mpi) == sorted(ring) and ring
    diff = 0.0
    for k in ring:
        assert by_mpi[k].shape == ring[k].shape, k
        assert np.allclose(by_mpi[k], ring[k], rtol=1e-5, atol=1e-6), (
            f"{k}: max |diff| {np.max(np.abs(by_mpi[k] - ring[k]))}"
        )
        if np.issubdtype(ring[k].dtype, np.number):
            diff = max(diff, float(np.max(np.abs(by_mpi[k] - ring[k]), initial=0.0)))
    for kind, (st, _) in runs.items():
        print(
            json.dumps(
                {
                    "where": "local cluster",
                    "job": kind,
                    "steps": WEIGHT_STEPS,
                    "startTime": st.get("startTime"),
                    "completionTime": st.get("completionTime"),
                    "progress": st["progress"],
                    "final_weights_max_abs_diff_vs_ring": diff,
                    "arrays": len(ring),
                }
            )
        )


KILL_STEPS, KILL_EVERY = 900, 50


def rank_pid(kubectl, ns: str, pod: str, rank: int) -> int | None:
    """The host pid of MPI rank ``rank`` among the pod's processes (sshd's descendants), by the
    ``OMPI_COMM_WORLD_RANK`` Open MPI gives each rank."""
    mark = f"OMPI_COMM_WORLD_RANK={rank}".encode()
    for pid in host_pids(container_id(kubectl, ns, pod)):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            return pid
    return None


def progress_steps(log: str) -> list[int]:
    """The steps of rank 0's progress events in a launcher log."""
    out = []
    for line in log.splitlines():
        if line.startswith("{") and '"progress"' in line:
            try:
                out.append(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    return out


def test_a_rank_killed_mid_run_restarts_the_launcher_and_resumes_from_worker_0s_checkpoint(
    kubectl, namespace, operator, image
):
    """SIGKILL rank 1 (in worker 1, from the node) once rank 0 has a checkpoint in worker 0's
    default emptyDir: mpirun fails, the launcher restarts in place (OnFailure, one restart
    counted), no pod is replaced, the ranks resume past the checkpoint and the job Succeeds."""
    name = "mpi-kill"
    doc = example(image, name, steps=KILL_STEPS, checkpoint={"everySteps": KILL_EVERY})
    # cleanPodPolicy None: the workers are still there to show they were never replaced
    doc["spec"]["runPolicy"].update(backoffLimit=3, cleanPodPolicy="None")
    assert "volume" not in doc["spec"]["trainer"]["checkpoint"]
    apply(kubectl, doc, namespace)
    launcher, worker0, worker1 = (f"{name}-{p}" for p in ("launcher", "worker-0", "worker-1"))

    def story() -> str:
        return job_story(kubectl, namespace, name, operator.tail)

    # the launcher exists and rank 0 has committed a checkpoint into worker 0's emptyDir
    def checkpointed() -> int | None:
        st = (get_job(kubectl, namespace, name) or {}).get("status") or {}
        if st.get("state") != "Running":
            return None
        return newest_checkpoint_step(kubectl, namespace, worker0)

    checkpoint = wait_for("rank 0's first checkpoint", checkpointed, 420, story, poll_s=0.5)
    uids = {
        p: kubectl.json("get", "pod", p, "-n", namespace)["metadata"]["uid"]
        for p in (launcher, worker0, worker1)
    }
    pid = wait_for("rank 1's process", lambda: rank_pid(kubectl, namespace, worker1, 1), 60, story)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    exits = ExitRecorder(kubectl, namespace, name)
    job = wait_state(kubectl, namespace, name, "Succeeded", 480, operator.tail, observe=exits)
    st = job["status"]
    assert checkpoint >= KILL_EVERY and st["progress"]["step"] == KILL_STEPS, st
    assert st["restarts"] == 1 and st.get("gangRestarts", 0) == 0, st
    pods = {p: kubectl.json("get", "pod", p, "-n", namespace) for p in uids}
    assert {p: o["metadata"]["uid"] for p, o in pods.items()} == uids, "no pod was replaced"
    restarts = {p: o["status"]["containerStatuses"][0]["restartCount"] for p, o in pods.items()}
    assert restarts == {launcher: 1, worker0: 0, worker1: 0}, "only mpirun ran again"
    assert exits.exit_before(launcher, 1) not in (None, 0), exits.exits
    evs = events(kubectl, namespace, name)
    restarting = [e["message"] for e in evs if e["reason"] == "TrainingJobRestarting"]
    assert restarting and all(
        f"pod {launcher} failed" in m
        and "mpirun starts every rank again from the last checkpoint" in m
        for m in restarting
    ), restarting
    reasons = [e["reason"] for e in evs]
    assert "PodDeleted" not in reasons and "TrainingJobSucceeded" in reasons
    assert sum(e.get("count", 1) for e in evs if e["reason"] == "PodCreated") == 3
    # rank 0 reports its first step at once: a run from scratch says step 1, the restarted
    # one a step past worker 0's checkpoint (the killed run's log may be collected already)
    log = kubectl("logs", "-n", namespace, launcher).stdout
    after = progress_steps(log)
    assert after and after[0] > checkpoint, (checkpoint, after[:3], log[-3000:])
    assert after[-1] == KILL_STEPS
    print(
        json.dumps(
            {
                "what": "rank 1 SIGKILLed on the cluster",
                "steps": KILL_STEPS,
                "checkpoint_every": KILL_EVERY,
                "checkpoint_when_killed": checkpoint,
                "first_progress_after": after[0],
                "restarts": st["restarts"],
                "kill_to_succeeded_s": round(time.monotonic() - killed, 1),
                "final_state": st["state"],
            }
        )
    )
