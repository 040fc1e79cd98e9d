"""Faults on the real cluster, at random moments, each ending Succeeded with the chief's final
weights bit-identical to an undisturbed run of the same spec (same steps, same checkpoint
cadence): a resumed gang recomputes the same steps from the chief's checkpoint (the data
position and the optimizer state are in it, the ring's reduction order is fixed), so nothing but
time is lost. docs/reliability.md is the table of what these show.

The checkpoints go to a host directory (hostPath) only so that the test can read the final
weights; for a restart in place it behaves as the default emptyDir does (test_lifecycle.py runs
that one)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_support import OperatorProcess, fresh_namespace, job_pods, sleep_job, wait_for, wait_state
from fault_support import (
    EVERY,
    REJOINED,
    STEPS,
    ExitRecorder,
    NetNS,
    WitnessNode,
    assert_same_weights,
    ckpt_dir,
    committed_steps,
    container_id,
    container_log,
    container_statuses,
    ctr_kill,
    dead,
    events,
    fault_job,
    final_weights,
    host_pids,
    kill_the_operator_repeatedly,
    newest_step,
    pods_created,
    progress_steps,
    rejoins,
    signal_all,
    sleep_until,
    story,
    undisturbed,
    wait_training,
)

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


@pytest.fixture(scope="module")
def reference(kubectl, ns, operator, project_image):
    return undisturbed(kubectl, ns, operator, project_image)


@pytest.mark.slow
def test_members_sigkilled_ten_times_in_one_job(kubectl, ns, operator, project_image):
    """Ten SIGKILLs at random moments, each of a random member (the chief too) among those
    killed least so far, each once the gang has re-formed and committed a new checkpoint.
    Each kill restarts only the victim's container (the kubelet's back-off per container, 0,
    10, 20, 40 s by default, 0, 1, 2, 4 s on the tests' cluster, is paid by it alone); the
    survivors rejoin the ring in their own containers. One failure, one restart:
    status.restarts ends at 10 exactly."""
    name, replicas, kills, steps = "kill10", 3, 10, LONG_STEPS
    reference = undisturbed(kubectl, ns, operator, project_image, steps, replicas)
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(
        fault_job(
            name,
            project_image,
            ckpt,
            backoff=kills + 2,
            steps=steps,
            replicas=replicas,
            activeDeadlineSeconds=1500,
        ),
        ns,
    )
    members = [f"{name}-worker-{i}" for i in range(replicas)]
    killed = dict.fromkeys(members, 0)
    uids, at, t0 = None, [], time.monotonic()
    for _ in range(kills):
        wait_training(kubectl, ns, name, operator, ckpt, killed, timeout_s=400)
        uids = uids or {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
        time.sleep(RNG.uniform(0, 1.5))  # a random moment: steps take milliseconds
        if newest_step(ckpt) >= steps:
            break
        victim = RNG.choice([m for m in members if killed[m] == min(killed.values())])
        past = newest_step(ckpt)
        ctr_kill(container_id(kubectl, ns, victim))
        killed[victim] += 1
        at.append((round(time.monotonic() - t0), victim.rsplit("-", 1)[1], past))
    done = wait_state(kubectl, ns, name, "Succeeded", 900, operator.tail)
    st = done["status"]
    assert len(at) == kills, f"the job finished after {len(at)} kills: {at}"
    assert st["progress"]["step"] == steps and st.get("gangRestarts", 0) == 0
    assert {p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)} == uids
    cs = container_statuses(kubectl, ns, name)
    assert {m: cs[m]["restartCount"] for m in members} == killed, "only the victims restarted"
    assert st["restarts"] == kills
    assert pods_created(kubectl, ns, name) == replicas
    for m in members:  # every kill of another member since its own last restart: one rejoin
        own = max([i for i, a in enumerate(at) if a[1] == m.rsplit("-", 1)[1]], default=-1)
        assert rejoins(kubectl, ns, m) == len(at) - 1 - own, (m, at)
    assert_same_weights(final_weights(ckpt, steps), reference)
    first = progress_steps(kubectl, ns, f"{name}-worker-0")[0]
    assert first > at[-1][2], "the chief resumed from its checkpoint"
    print(
        f"{kills} kills at (s, worker, last checkpoint step): {at}; restarts {st['restarts']}; "
        f"took {time.monotonic() - t0:.0f}s"
    )


def test_the_chief_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
    kubectl, ns, operator, project_image, reference
):
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
        return [
            n
            for n in names
            if ".tmp-" in n or (n.endswith(".npz") and n[:-4] + ".json" not in names)
        ]

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
    exits = ExitRecorder(kubectl, ns, name)
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail, observe=exits)
    cs = container_statuses(kubectl, ns, name)
    assert cs[chief]["restartCount"] == 1
    assert exits.exit_before(chief, 1) == 137, exits.exits
    resumed = progress_steps(kubectl, ns, chief)[0]
    assert committed[-1] < resumed <= committed[-1] + EVERY, (committed, resumed)
    assert done["status"]["progress"]["step"] == STEPS
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"chief killed mid-write of {partial} (after {tries} freezes); committed {committed}; "
        f"its first progress after the restart: step {resumed}"
    )


@pytest.mark.slow
def test_the_operator_sigkilled_twenty_times_during_one_job(kubectl, ns, operator, project_image):
    # 20 kills take ~30-40 s; the job must outlast them (4,000 steps no longer did once the
    # compiled Adam stopped paying for denormals), so it trains 12,000
    kill_the_operator_repeatedly(kubectl, ns, operator, project_image, 20, "opkill20", 12000, RNG)


def test_a_worker_pod_deleted_by_hand_is_recreated_and_the_job_resumes(
    kubectl, ns, operator, project_image, reference
):
    """worker-1's pod deleted (SIGTERM: a stop vote, the gang checkpoints at one step and
    exits 143): its pod is recreated, the chief restarts in place (or, had worker-1 gone before
    the vote reached it, rejoins in its own container) and resumes from its own checkpoint —
    an off-cadence one, the stop's, which recomputes exactly as well."""
    name = "podgone"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt, backoff=4), ns)
    past = wait_training(kubectl, ns, name, operator, ckpt)
    time.sleep(RNG.uniform(0, 1.5))
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    kubectl("delete", "pod", f"{name}-worker-1", "-n", ns, "--wait=false")
    exits = ExitRecorder(kubectl, ns, name)
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail, observe=exits)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    assert after[f"{name}-worker-0"] == before[f"{name}-worker-0"]
    assert after[f"{name}-worker-1"] != before[f"{name}-worker-1"]
    assert pods_created(kubectl, ns, name) == 3
    chief = container_statuses(kubectl, ns, name)[f"{name}-worker-0"]
    how = (
        f"exited {exits.exit_before(f'{name}-worker-0', 1)}"
        if chief["restartCount"]
        else f"rejoined {rejoins(kubectl, ns, f'{name}-worker-0')} time(s)"
    )
    assert how in ("exited 143", "exited 138", "rejoined 1 time(s)"), how
    assert progress_steps(kubectl, ns, f"{name}-worker-0")[0] > past
    assert done["status"]["progress"]["step"] == STEPS
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"worker-1 deleted after checkpoint step {past}; the chief {how}; restarts "
        f"{done['status']['restarts']}"
    )


def test_a_worker_network_cut_longer_than_the_ring_timeouts_rejoins_and_resumes(
    kubectl, ns, operator, project_image, reference
):
    """worker-1's eth0 down for 20 s, far beyond the control plane's health timeout (3 s):
    no hang; both sides find the other silent, leave the ring and rejoin it in their own
    containers — no container restarts, nothing counted — and the gang re-forms once the link
    is back (the connect timeout, 300 s, covers the wait); the result equals the undisturbed
    run."""
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
        noticed = wait_for(
            "the chief to leave the ring",
            lambda: rejoins(kubectl, ns, f"{name}-worker-0") >= 1 and time.monotonic() - t_cut,
            60,
            story(kubectl, ns, name, operator),
            poll_s=0.5,
        )
        sleep_until(t_cut + 20)
    finally:
        netns.link(up=True)
        netns.close()
    done = wait_state(kubectl, ns, name, "Succeeded", 600, operator.tail)
    cs = container_statuses(kubectl, ns, name)
    assert {n: c["restartCount"] for n, c in cs.items()} == {
        f"{name}-worker-0": 0,
        f"{name}-worker-1": 0,
    }
    assert done["status"]["restarts"] == 0
    assert rejoins(kubectl, ns, f"{name}-worker-1") >= 1
    assert done["status"]["progress"]["step"] == STEPS
    assert progress_steps(kubectl, ns, f"{name}-worker-0")[0] > cut_at >= past
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"cut after checkpoint step {cut_at}; the chief left the ring {noticed:.1f}s after; "
        f"rejoins { {n: rejoins(kubectl, ns, n) for n in cs} }; status.restarts "
        f"{done['status']['restarts']}"
    )


def test_a_frozen_worker_is_left_at_once_and_its_liveness_probe_restarts_it(
    kubectl, ns, operator, project_image, reference
):
    """worker-1 frozen (SIGSTOP to every process of its container): the chief's health checks
    find it silent within seconds — far below the step timeout (30 s) — it names worker-1,
    leaves the ring and waits in its container for a new worker-1; the pod's liveness probe
    (the gRPC Health service, 4 × 15 s) has the kubelet restart the frozen container, and the
    gang resumes from the chief's checkpoint; the result equals the undisturbed run."""
    name = "frozen"
    ckpt = ckpt_dir(ns, name)
    kubectl.apply(fault_job(name, project_image, ckpt, backoff=4), ns)
    past = wait_training(kubectl, ns, name, operator, ckpt)
    time.sleep(RNG.uniform(0, 1.5))
    frozen_at = newest_step(ckpt)
    signal_all(host_pids(container_id(kubectl, ns, f"{name}-worker-1")), signal.SIGSTOP)
    t0 = time.monotonic()
    left = wait_for(
        "the chief to leave the ring",
        lambda: rejoins(kubectl, ns, f"{name}-worker-0") >= 1 and time.monotonic() - t0,
        60,
        story(kubectl, ns, name, operator),
        poll_s=0.5,
    )
    exits = ExitRecorder(kubectl, ns, name)
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail, observe=exits)
    why = container_log(kubectl, ns, f"{name}-worker-0").split(REJOINED)[0]
    cause = [line for line in why.splitlines() if "ringtrain worker: PeerTimeout" in line]
    cs = container_statuses(kubectl, ns, name)
    assert left < 10, f"left {left:.1f}s after the freeze: not well before the step timeout"
    assert cause and "worker-1" in cause[-1], why[-2000:]
    assert cs[f"{name}-worker-0"]["restartCount"] == 0
    assert cs[f"{name}-worker-1"]["restartCount"] == 1
    assert exits.exit_before(f"{name}-worker-1", 1) == 137, exits.exits
    assert done["status"]["restarts"] == 1
    assert progress_steps(kubectl, ns, f"{name}-worker-0")[0] > frozen_at >= past
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"worker-1 frozen after checkpoint step {frozen_at}; the chief left {left:.1f}s later "
        f"({cause[-1].split(': ', 2)[-1][:160]}); the liveness probe restarted worker-1; "
        f"Succeeded {time.monotonic() - t0:.0f}s after the freeze"
    )


def test_backoff_limit_reached_fails_and_cleans_up(kubectl, ns, operator, project_image):
    """A worker that keeps dying with a retryable code (137) under backoffLimit 1: Failed,
    BackoffLimitExceeded, cleanPodPolicy Running deletes the (restarting, phase Running) pods,
    nothing is left running. The deadline's twin is test_lifecycle.py's."""
    name = "backoff"
    job = sleep_job(
        name, project_image, run_policy={"backoffLimit": 1, "cleanPodPolicy": "Running"}
    )
    job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python",
        "-c",
        "import os, time; time.sleep(2); os._exit(137)",
    ]
    kubectl.apply(job, ns)
    done = wait_state(
        kubectl, ns, name, "Failed", 180, operator.tail, reason="BackoffLimitExceeded"
    )
    assert done["status"]["restarts"] <= 1
    wait_for(
        "cleanPodPolicy Running to delete the pods",
        lambda: job_pods(kubectl, ns, name) == [],
        60,
        story(kubectl, ns, name, operator),
    )
    ev = [e for e in events(kubectl, ns, name) if e["reason"] == "BackoffLimitExceeded"]
    assert ev and ev[0]["type"] == "Warning"


def test_the_api_server_restarted_mid_job_the_workers_never_notice(
    kubectl, ns, operator, project_image, reference
):
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
    up = subprocess.run(
        [str(REPO / "hack" / "local-cluster"), "up"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    assert operator.proc.poll() is None, "the operator survived the API server's absence"
    cs = container_statuses(kubectl, ns, name)
    assert all(c["restartCount"] == 0 for c in cs.values()), cs
    assert done["status"]["restarts"] == 0 and done["status"]["progress"]["step"] == STEPS
    assert down_at > past, "the workers trained while the API server was away"
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"API server away ~{time.monotonic() - t0:.0f}s; checkpoints went from {past} to "
        f"{down_at} meanwhile"
    )


def test_the_node_lost_long_enough_for_its_pods_to_be_lost_recreates_them_and_resumes(
    kubectl, ns, operator, project_image, reference
):
    """A node loss as one node can have it: the kubelet SIGKILLed and the node's containers
    killed with it (a crashed machine). The node controller marks the node unreachable after
    its grace period (40 s, Kubernetes' default) and the taint manager evicts the pods after
    their toleration of that (5 s here, set in the pod template as a user would; the default
    is 300 s). The kubelet comes back (`hack/local-cluster up`: the node rebooted) and
    finishes the deletions; the operator recreates both pods, and the new chief resumes from
    the volume that outlived its pod (hostPath; a PVC on a real cluster). A witness node
    (fault_support.WitnessNode) keeps the cluster from being "all nodes down", where
    Kubernetes evicts nothing."""
    name = "nodeloss"
    ckpt = ckpt_dir(ns, name)
    job = fault_job(name, project_image, ckpt, backoff=4)
    job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["tolerations"] = [
        {
            "key": f"node.kubernetes.io/{t}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 5,
        }
        for t in ("unreachable", "not-ready")
    ]
    with WitnessNode(kubectl):
        kubectl.apply(job, ns)
        past = wait_training(kubectl, ns, name, operator, ckpt)
        time.sleep(RNG.uniform(0, 1.5))
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
        cids = [container_id(kubectl, ns, pod) for pod in before]
        pid = int((STATE / "run" / "kubelet.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        for cid in cids:
            ctr_kill(cid)
        lost_at, t0 = newest_step(ckpt), time.monotonic()
        try:
            evicted = wait_for(
                "the node's pods to be evicted",
                lambda: (
                    (pods := job_pods(kubectl, ns, name))
                    and all(p["metadata"].get("deletionTimestamp") for p in pods)
                    and time.monotonic() - t0
                ),
                150,
                story(kubectl, ns, name, operator),
                poll_s=1,
            )
            node = kubectl.json("get", "node", "-l", "!ringtrain.io/witness")["items"][0]
            ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
            taints = {t["key"] for t in node["spec"].get("taints", [])}
        finally:
            up = subprocess.run(
                [str(REPO / "hack" / "local-cluster"), "up"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        assert up.returncode == 0, up.stdout + up.stderr
        assert ready["status"] == "Unknown" and "node.kubernetes.io/unreachable" in taints
        done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(kubectl, ns, name)}
    assert sorted(after) == sorted(before) and not set(after.values()) & set(before.values())
    assert pods_created(kubectl, ns, name) == 4
    assert done["status"]["progress"]["step"] == STEPS
    resumed = progress_steps(kubectl, ns, f"{name}-worker-0")[0]
    assert lost_at < resumed <= lost_at + EVERY, (lost_at, resumed)
    assert_same_weights(final_weights(ckpt), reference)
    print(
        f"node lost after checkpoint step {lost_at} (training from {past}); pods evicted "
        f"{evicted:.0f}s after; both recreated, the chief resumed at step {resumed}; "
        f"status.restarts {done['status']['restarts']}"
    )
