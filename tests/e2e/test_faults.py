"""Faults on the real cluster, at random moments, each ending Succeeded with the chief's final
weights bit-identical to an undisturbed run of the same spec (same steps, same checkpoint
cadence): a resumed gang recomputes the same steps from the chief's checkpoint (the data
position and the optimizer state are in it, the ring's reduction order is fixed), so nothing but
time is lost. docs/reliability.md is the table of what these show.

The checkpoints go to a host directory (hostPath) only so that the test can read the final
weights; for a restart in place it behaves as the default emptyDir does (test_lifecycle.py runs
that one). `-m faults_long` adds the longer runs (more kills than CI's budget holds)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2e_support import (OperatorProcess, fresh_namespace, get_job, job_pods, job_story, sleep_job,
                         wait_for, wait_state)
from fault_support import (EVERY, STEPS, assert_same_weights, committed_steps,
                           container_id, container_statuses, ctr_kill, fault_job,
                           final_weights, gang_running, host_pids, NetNS, dead, newest_step,
                           progress_steps, signal_all, sleep_until)

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("RINGTRAIN_CLUSTER_DIR", "/var/lib/ringtrain-cluster"))
LONG_STEPS = 1200
RNG = random.Random(int(os.environ.get("RINGTRAIN_FAULT_SEED", "12")))


@pytest.fixture(scope="module")
def ns(kubectl):
    with fresh_namespace(kubectl, "e2e-faults") as name:
        yield name
    shutil.rmtree(f"/tmp/ringtrain-e2e/{name}", ignore_errors=True)


@pytest.fixture(scope="module")
def operator(kubeconfig, kubectl, ns, tmp_path_factory):
    op = OperatorProcess(kubeconfig, [ns], tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    if op.proc.poll() is not None:
        op.start()
    # While the operator still runs to remove its finalizers: the namespace then goes at once.
    kubectl("delete", "tj", "--all", "-n", ns, "--timeout=60s", check=False, timeout=90)
    op.stop()


def ckpt_dir(ns: str, name: str) -> Path:
    return Path(f"/tmp/ringtrain-e2e/{ns}/{name}")


def story(kubectl, ns, name, operator):
    return lambda: job_story(kubectl, ns, name, operator.tail)


def events(kubectl, ns: str, name: str) -> list[dict]:
    return kubectl.json("get", "events", "-n", ns,
                        "--field-selector", f"involvedObject.name={name}")["items"]


def pods_created(kubectl, ns, name) -> int:
    return sum(e.get("count", 1) for e in events(kubectl, ns, name)
               if e["reason"] == "PodCreated")


def undisturbed(kubectl, ns, operator, image, steps: int = STEPS) -> dict:
    """The final weights of an undisturbed run, which every faulted run of ``steps`` equals."""
    name = f"reference-{steps}"
    ckpt = ckpt_dir(ns, name)
    t0 = time.monotonic()
    kubectl.apply(fault_job(name, image, ckpt, steps=steps), ns)
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    assert done["status"]["restarts"] == 0
    print(f"undisturbed run of {steps} steps: {time.monotonic() - t0:.0f}s")
    return final_weights(ckpt, steps)


@pytest.fixture(scope="module")
def reference(kubectl, ns, operator, project_image):
    return undisturbed(kubectl, ns, operator, project_image)


def wait_training(kubectl, ns, name, operator, ckpt: Path, restarts: int = 0,
                  timeout_s=300) -> int:
    """Wait until both members run again after ``restarts`` restarts each, then until the chief
    commits a checkpoint it made since (the gang trains again); return that step."""
    def restarted():
        cs = container_statuses(kubectl, ns, name)
        return (len(cs) == 2 and gang_running(kubectl, ns, name)
                and all(c.get("restartCount", 0) >= restarts for c in cs.values()))

    wait_for(f"both members running after {restarts} restarts", restarted, timeout_s,
             story(kubectl, ns, name, operator), poll_s=0.3)
    since = newest_step(ckpt)
    return wait_for(f"a checkpoint after step {since}", lambda: newest_step(ckpt) > since
                    and newest_step(ckpt), timeout_s, story(kubectl, ns, name, operator),
                    poll_s=0.2)


def kill_worker_repeatedly(kubectl, ns, operator, image, reference, kills: int, name: str,
                           steps: int = STEPS):
    ckpt = ckpt_dir(ns, name)
    # Each fault restarts both members in place (worker-1 137, the chief 138). Training
    # waits out the kubelet's back-off: only 1-3 checkpoint intervals are trained per kill.
    kubectl.apply(fault_job(name, image, ckpt, backoff=2 * kills + 2, steps=steps,
                            activeDeadlineSeconds=600 + 200 * kills), ns)
    victim = f"{name}-worker-1"
    uids = None
    at, t0 = [], time.monotonic()
    for k in range(kills):
        wait_training(kubectl, ns, name, operator, ckpt, restarts=k, timeout_s=400)
        uids = uids or {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
        time.sleep(RNG.uniform(0, 1.5))  # a random moment: steps take milliseconds
        if newest_step(ckpt) >= steps:
            break
        past = newest_step(ckpt)
        ctr_kill(container_id(kubectl, ns, victim))
        at.append((round(time.monotonic() - t0), past))
    done = wait_state(kubectl, ns, name, "Succeeded", 900, operator.tail)
    st = done["status"]
    assert len(at) == kills, f"the job finished after {len(at)} kills: {at}"
    assert st["progress"]["step"] == steps and st.get("gangRestarts", 0) == 0
    assert {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)} == uids
    cs = container_statuses(kubectl, ns, name)
    assert cs[victim]["restartCount"] == kills
    assert st["restarts"] == sum(c["restartCount"] for c in cs.values()) >= kills
    assert pods_created(kubectl, ns, name) == 2
    assert_same_weights(final_weights(ckpt, steps), reference)
    first = progress_steps(kubectl, ns, f"{name}-worker-0")[0]
    assert first > at[-1][1], "the chief resumed from its checkpoint"
    print(f"{kills} kills at (s, last checkpoint step): {at}; restarts {st['restarts']}; "
          f"took {time.monotonic() - t0:.0f}s")


def test_a_worker_sigkilled_three_times_at_random_moments(kubectl, ns, operator,
                                                          project_image, reference):
    """Three in CI's budget: the kubelet's crash back-off grows per fault (0, 10, 20 s)."""
    kill_worker_repeatedly(kubectl, ns, operator, project_image, reference, 3, "kill3")


@pytest.mark.faults_long
@pytest.mark.timeout(3000)
def test_a_worker_sigkilled_ten_times_in_one_job(kubectl, ns, operator, project_image):
    """Ten kills: the back-off (0, 10, 20 ... 300 s) adds up to about 25 minutes."""
    kill_worker_repeatedly(kubectl, ns, operator, project_image,
                           undisturbed(kubectl, ns, operator, project_image, LONG_STEPS), 10,
                           "kill10", steps=LONG_STEPS)


def test_the_chief_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
        kubectl, ns, operator, project_image, reference):
    """The chief is frozen (SIGSTOP) the moment a checkpoint's file appears uncommitted and,
    if it is still uncommitted once frozen, SIGKILLed: the half-written checkpoint is never
    used, the previous committed one is, and the result equals the undisturbed run."""
    name = "ckptkill"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt, backoff=4), ns)
    chief = f"{name}-worker-0"
    wait_training(kubectl, ns, name, operator, ckpt)
    pids = host_pids(container_id(kubectl, ns, chief))

    def uncommitted() -> list[str]:
        names = os.listdir(ckpt)
        return [n for n in names if ".tmp-" in n or (
            n.endswith(".npz") and n[:-4] + ".json" not in names)]

    caught, tries, deadline = None, 0, time.monotonic() + 60
    while caught is None and time.monotonic() < deadline:
        if not uncommitted():
            continue
        signal_all(pids, signal.SIGSTOP)
        tries += 1
        if partial := uncommitted():
            caught = (partial, committed_steps(ckpt))
            signal_all(pids, signal.SIGKILL)
        else:
            signal_all(pids, signal.SIGCONT)
    assert caught, f"no checkpoint write caught in 60s ({tries} tries)"
    partial, committed = caught
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    cs = container_statuses(kubectl, ns, name)
    assert cs[chief]["restartCount"] == 1
    assert cs[chief]["lastState"]["terminated"]["exitCode"] == 137
    resumed = progress_steps(kubectl, ns, chief)[0]
    assert committed[-1] < resumed <= committed[-1] + EVERY, (committed, resumed)
    assert done["status"]["progress"]["step"] == STEPS
    assert_same_weights(final_weights(ckpt), reference)
    print(f"chief killed mid-write of {partial} (after {tries} freezes); committed {committed}; "
          f"its first progress after the restart: step {resumed}")


def kill_the_operator_repeatedly(kubectl, ns, operator, image, kills: int, name: str,
                                 steps: int):
    """kill -9 at random points of its reconciles (0-2 s after each start: while it lists,
    creates the Service, Secret and pods, writes status, polls progress), all while the job
    trains: nothing duplicated or orphaned, the status never goes back, the job completes.
    The workers are never touched, so their weights are not compared."""
    ckpt = ckpt_dir(ns, name)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            st = (get_job(kubectl, ns, name) or {}).get("status") or {}
            pods = job_pods(kubectl, ns, name)
            seen.append((st.get("state"), (st.get("progress") or {}).get("step"),
                         st.get("restarts", 0), sorted(p["metadata"]["name"] for p in pods),
                         {p["metadata"]["uid"] for p in pods}))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    operator.kill9()
    kubectl.apply(fault_job(name, image, ckpt, steps=steps), ns)
    done_kills, last_at = 0, 0
    try:
        while done_kills < kills:
            operator.start()
            time.sleep(RNG.uniform(0, 2.0))
            operator.kill9()
            done_kills += 1
        last_at = newest_step(ckpt)
        operator.start()
        done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    finally:
        stop.set()
        watcher.join(10)
        if operator.proc.poll() is not None:
            operator.start()
    assert last_at < steps, "the last kill came after training ended"
    order = {None: 0, "Created": 1, "Running": 2, "Succeeded": 3}
    progress = [s[1] for s in seen if s[1] is not None]
    assert progress == sorted(progress), "progress went back"
    ranks = [order.get(s[0], -1) for s in seen]
    assert ranks == sorted(ranks), [s[0] for s in seen]
    assert all(s[2] == 0 for s in seen), "a restart was counted"
    assert all(s[3] in ([], [f"{name}-worker-0"], [f"{name}-worker-0", f"{name}-worker-1"],
                        [f"{name}-worker-1"]) for s in seen), {tuple(s[3]) for s in seen}
    uids = set().union(*(s[4] for s in seen))
    assert len(uids) == 2, "a pod was created twice"
    assert pods_created(kubectl, ns, name) == 2
    assert done["status"]["restarts"] == 0 and done["status"]["progress"]["step"] == steps
    assert newest_step(ckpt) == steps
    print(f"{done_kills} operator kills, the last at checkpoint step {last_at} of {steps}; "
          f"{len(seen)} status samples, states "
          f"{sorted({s[0] for s in seen}, key=lambda s: order.get(s, -1))}")


def test_the_operator_sigkilled_ten_times_during_one_job(kubectl, ns, operator, project_image):
    kill_the_operator_repeatedly(kubectl, ns, operator, project_image, 10, "opkill10", 1200)


@pytest.mark.faults_long
def test_the_operator_sigkilled_twenty_times_during_one_job(kubectl, ns, operator,
                                                            project_image):
    kill_the_operator_repeatedly(kubectl, ns, operator, project_image, 20, "opkill20", 4000)


def test_a_worker_pod_deleted_by_hand_is_recreated_and_the_job_resumes(
        kubectl, ns, operator, project_image, reference):
    """worker-1's pod deleted (SIGTERM: a stop vote, the gang checkpoints at one step and
    exits 143): its pod is recreated, the chief restarts in place and resumes from its own
    checkpoint — an off-cadence one, the stop's, which recomputes exactly as well."""
    name = "podgone"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt, backoff=4), ns)
    past = wait_training(kubectl, ns, name, operator, ckpt)
    time.sleep(RNG.uniform(0, 1.5))
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    kubectl("delete", "pod", f"{name}-worker-1", "-n", ns, "--wait=false")
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    assert after[f"{name}-worker-0"] == before[f"{name}-worker-0"]
    assert after[f"{name}-worker-1"] != before[f"{name}-worker-1"]
    assert pods_created(kubectl, ns, name) == 3
    chief = container_statuses(kubectl, ns, name)[f"{name}-worker-0"]
    assert chief["restartCount"] >= 1
    assert chief["lastState"]["terminated"]["exitCode"] in (138, 143)
    assert progress_steps(kubectl, ns, f"{name}-worker-0")[0] > past
    assert done["status"]["progress"]["step"] == STEPS
    assert_same_weights(final_weights(ckpt), reference)
    print(f"worker-1 deleted after checkpoint step {past}; chief exited "
          f"{chief['lastState']['terminated']['exitCode']}; restarts {done['status']['restarts']}")


def test_a_worker_network_cut_longer_than_the_ring_timeouts_restarts_and_resumes(
        kubectl, ns, operator, project_image, reference):
    """worker-1's eth0 down for 20 s, far beyond the control plane's health timeout (3 s):
    no hang, the gang restarts in place and re-forms once the link is back (the connect
    timeout, 300 s, covers the wait); the result equals the undisturbed run."""
    name = "netcut"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt, backoff=6), ns)
    past = wait_training(kubectl, ns, name, operator, ckpt)
    time.sleep(RNG.uniform(0, 1.5))
    netns = NetNS(host_pids(container_id(kubectl, ns, f"{name}-worker-1"))[0])
    cut_at = newest_step(ckpt)
    netns.link(up=False)
    t_cut = time.monotonic()
    try:
        noticed = wait_for("the chief to leave the ring", lambda: container_statuses(
            kubectl, ns, name)[f"{name}-worker-0"].get("restartCount", 0) >= 1
            and time.monotonic() - t_cut, 60, story(kubectl, ns, name, operator), poll_s=0.5)
        sleep_until(t_cut + 20)
    finally:
        netns.link(up=True)
        netns.close()
    done = wait_state(kubectl, ns, name, "Succeeded", 600, operator.tail)
    cs = container_statuses(kubectl, ns, name)
    assert cs[f"{name}-worker-0"]["restartCount"] >= 1
    assert done["status"]["progress"]["step"] == STEPS
    assert progress_steps(kubectl, ns, f"{name}-worker-0")[0] > cut_at >= past
    assert_same_weights(final_weights(ckpt), reference)
    print(f"cut after checkpoint step {cut_at}; the chief restarted {noticed:.1f}s after; restarts "
          f"{ {n: c['restartCount'] for n, c in cs.items()} }; status.restarts "
          f"{done['status']['restarts']}")


def test_backoff_limit_reached_fails_and_cleans_up(kubectl, ns, operator, project_image):
    """A worker that keeps dying with a retryable code (137) under backoffLimit 1: Failed,
    BackoffLimitExceeded, cleanPodPolicy Running deletes the (restarting, phase Running) pods,
    nothing is left running. The deadline's twin is test_lifecycle.py's."""
    name = "backoff"
    job = sleep_job(name, project_image, run_policy={"backoffLimit": 1,
                                                     "cleanPodPolicy": "Running"})
    job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python", "-c", "import os, time; time.sleep(2); os._exit(137)"]
    kubectl.apply(job, ns)
    done = wait_state(kubectl, ns, name, "Failed", 180, operator.tail,
                      reason="BackoffLimitExceeded")
    assert done["status"]["restarts"] <= 1
    wait_for("cleanPodPolicy Running to delete the pods",
             lambda: job_pods(kubectl, ns, name) == [], 60, story(kubectl, ns, name, operator))
    ev = [e for e in events(kubectl, ns, name) if e["reason"] == "BackoffLimitExceeded"]
    assert ev and ev[0]["type"] == "Warning"


def test_the_api_server_restarted_mid_job_the_workers_never_notice(
        kubectl, ns, operator, project_image, reference):
    """kube-apiserver SIGKILLed, away for 10 s, and started again by hack/local-cluster up:
    the operator reconnects and records the success; the workers never restart. (SIGKILL: a
    SIGTERMed 1.20 API server closes its port at once but its process lingers ~60 s while
    its watches drain, and `up` waits on that process.)"""
    name = "apiserver"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt), ns)
    past = wait_training(kubectl, ns, name, operator, ckpt)
    pid = int((STATE / "run" / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while not dead(pid) and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    time.sleep(10)
    down_at = newest_step(ckpt)
    up = subprocess.run([str(REPO / "hack" / "local-cluster"), "up"], capture_output=True,
                        text=True, timeout=300, check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    assert operator.proc.poll() is None, "the operator survived the API server's absence"
    cs = container_statuses(kubectl, ns, name)
    assert all(c["restartCount"] == 0 for c in cs.values()), cs
    assert done["status"]["restarts"] == 0 and done["status"]["progress"]["step"] == STEPS
    assert down_at > past, "the workers trained while the API server was away"
    assert_same_weights(final_weights(ckpt), reference)
    print(f"API server away ~{time.monotonic() - t0:.0f}s; checkpoints went from {past} to "
          f"{down_at} meanwhile")
