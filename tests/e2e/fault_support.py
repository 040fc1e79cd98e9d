"""What the fault tests share: one job spec whose every run trains the same steps with the same
checkpoint cadence into a host directory (so the test can read the chief's final weights), the
comparison with an undisturbed run, the waits between faults, and the ways to hurt a container
from the node: SIGKILL, SIGSTOP, its network namespace's link, a witness node."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from e2e_support import get_job, job_pods, job_story, training_job, wait_for, wait_state

CTR = ["ctr", "--address", "/run/ringtrain-containerd/containerd.sock", "-n", "k8s.io"]
STEPS = 600
EVERY = 20


def fault_job(
    name: str,
    image: str,
    ckpt: Path,
    backoff: int = 2,
    steps: int = STEPS,
    replicas: int = 2,
    **run_policy,
) -> dict:
    """The one spec every fault test runs: cleanPodPolicy None keeps the pods to inspect; the
    connect timeout covers the kubelet's growing crash back-off (docs/operator.md)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    ckpt.chmod(0o777)
    return training_job(
        name,
        image,
        replicas=replicas,
        steps=steps,
        run_policy={
            "cleanPodPolicy": "None",
            "backoffLimit": backoff,
            "activeDeadlineSeconds": 900,
            **run_policy,
        },
        checkpoint={
            "everySteps": EVERY,
            "volume": {"hostPath": {"path": str(ckpt), "type": "Directory"}},
        },
        ring={"connectTimeoutSeconds": 300},
    )


def committed_steps(ckpt: Path) -> list[int]:
    """Steps of the checkpoints whose manifest (the commit record) is written."""
    out = []
    for f in ckpt.glob("ckpt-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):  # pruned or being replaced
            out.append(json.loads(f.read_text())["step"])
    return sorted(out)


def newest_step(ckpt: Path) -> int:
    steps = committed_steps(ckpt)
    return steps[-1] if steps else 0


def final_weights(ckpt: Path, steps: int = STEPS) -> dict[str, np.ndarray]:
    with np.load(ckpt / f"ckpt-{steps:010d}.npz") as z:
        return {k: z[k].copy() for k in z.files}


def assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and np.array_equal(got[k], want[k]), (
            f"{k}: max |diff| {np.max(np.abs(got[k] - want[k]))}"
        )


def container_id(kubectl, ns: str, pod: str) -> str:
    p = kubectl.json("get", "pod", pod, "-n", ns)
    return p["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]


def ctr_kill(cid: str, sig: str = "SIGKILL") -> None:
    subprocess.run(
        [*CTR, "tasks", "kill", "-s", sig, cid], check=True, capture_output=True, timeout=30
    )


def host_pids(cid: str) -> list[int]:
    """The container's processes as the node sees them (its init and every descendant)."""
    out = subprocess.run(
        [*CTR, "tasks", "ls"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    root = next(int(line.split()[1]) for line in out.splitlines() if line.startswith(cid))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                todo += [int(c) for c in (task / "children").read_text().split()]
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class NetNS:
    """A pod's network namespace, held open by a file descriptor: it outlives the container
    process it was found through (that one exits and is restarted while the link is down)."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)

    def ip(self, *args: str, check: bool = True) -> None:
        subprocess.run(
            ["nsenter", f"--net=/proc/{os.getpid()}/fd/{self.fd}", "ip", *args],
            check=check,
            capture_output=True,
            timeout=30,
            pass_fds=(self.fd,),
        )

    def link(self, up: bool) -> None:
        """eth0 down or up; the bridge CNI's default route goes with the link, so it is put
        back."""
        self.ip("link", "set", "eth0", "up" if up else "down")
        if up:
            self.ip("route", "replace", "default", "via", "10.244.0.1", "dev", "eth0")

    def close(self) -> None:
        os.close(self.fd)


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its sockets are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def container_statuses(kubectl, ns: str, name: str) -> dict[str, dict]:
    pods = kubectl.json("get", "pods", "-n", ns, "-l", f"ringtrain.io/job-name={name}")["items"]
    return {p["metadata"]["name"]: (p["status"].get("containerStatuses") or [{}])[0] for p in pods}


class ExitRecorder:
    """Every container exit the kubelet reports for a job's pods, as ``(pod, restartCount) ->
    exitCode``, recorded at each poll. Read afterwards, ``lastState`` may be empty: once a
    restarted container has finished too, the kubelet's container GC (one dead container kept
    per container) may remove the earlier one, and its exit with it."""

    def __init__(self, kubectl, ns: str, name: str):
        self.kubectl, self.ns, self.name = kubectl, ns, name
        self.exits: dict[tuple[str, int], int] = {}

    def __call__(self) -> None:
        for pod, cs in container_statuses(self.kubectl, self.ns, self.name).items():
            last = (cs.get("lastState") or {}).get("terminated")
            if last and cs.get("restartCount"):
                self.exits.setdefault((pod, cs["restartCount"]), last["exitCode"])

    def exit_before(self, pod: str, restart: int) -> int | None:
        """The exit code of the container that restart number ``restart`` replaced."""
        return self.exits.get((pod, restart))


class WitnessNode:
    """A second Node object that stays Ready (its Lease renewed from here), tainted so that
    nothing is scheduled on it. Without it, a single-node cluster whose one node goes silent
    is "all nodes not ready", where the node controller enters its master-disruption mode and
    evicts nothing (it assumes the control plane, not the nodes, lost the network)."""

    NAME = "ringtrain-witness"

    def __init__(self, kubectl) -> None:
        self.kubectl = kubectl
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True)

    @staticmethod
    def _now() -> str:
        return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def __enter__(self) -> WitnessNode:
        now = self._now()[:19] + "Z"
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "a witness node of the fault tests",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        self.kubectl.apply(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": self.NAME, "labels": {"ringtrain.io/witness": "true"}},
                "spec": {"taints": [{"key": "ringtrain.io/witness", "effect": "NoSchedule"}]},
                "status": {"conditions": [ready]},
            }
        )
        self._lease()
        self.thread.start()
        return self

    def _lease(self) -> None:
        self.kubectl.apply(
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.NAME, "namespace": "kube-node-lease"},
                "spec": {
                    "holderIdentity": self.NAME,
                    "leaseDurationSeconds": 40,
                    "renewTime": self._now(),
                },
            }
        )

    def _renew(self) -> None:
        while not self.stop.wait(5):  # the kubelet renews its own every 10 s
            self._lease()

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        self.kubectl("delete", "lease", self.NAME, "-n", "kube-node-lease", check=False)
        self.kubectl("delete", "node", self.NAME, check=False)


def gang_running(kubectl, ns: str, name: str, n: int = 2) -> bool:
    cs = container_statuses(kubectl, ns, name)
    return len(cs) == n and all("running" in (c.get("state") or {}) for c in cs.values())


REJOINED = "rejoining the ring in place"


def container_log(kubectl, ns: str, pod: str, previous: bool = False) -> str:
    return kubectl.log(pod, ns, "ringtrain", previous)


def progress_steps(kubectl, ns: str, pod: str, previous: bool = False) -> list[int]:
    """The steps of the chief's progress lines in its current (or previous) container's
    current process: a rejoin re-executes the process inside the same container, so only the
    lines after the last rejoin count."""
    log = container_log(kubectl, ns, pod, previous).split(REJOINED)[-1]
    return [
        json.loads(line)["step"]
        for line in log.splitlines()
        if line.startswith("{") and '"progress"' in line
    ]


def rejoins(kubectl, ns: str, pod: str) -> int:
    """Times the worker in the pod's current container rejoined the ring in place."""
    return container_log(kubectl, ns, pod).count(REJOINED)


def final_event(kubectl, ns: str, pod: str) -> dict:
    st = kubectl.json("get", "pod", pod, "-n", ns)["status"]["containerStatuses"][0]
    return json.loads(st["state"]["terminated"]["message"])


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


# ---- the fault tests' shared steps --------------------------------------------------------------


def ckpt_dir(ns: str, name: str) -> Path:
    return Path(f"/tmp/ringtrain-e2e/{ns}/{name}")


def story(kubectl, ns, name, operator):
    return lambda: job_story(kubectl, ns, name, operator.tail)


def events(kubectl, ns: str, name: str) -> list[dict]:
    return kubectl.json(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]


def pods_created(kubectl, ns, name) -> int:
    return sum(e.get("count", 1) for e in events(kubectl, ns, name) if e["reason"] == "PodCreated")


def undisturbed(kubectl, ns, operator, image, steps: int = STEPS, replicas: int = 2) -> dict:
    """The final weights of an undisturbed run, which every faulted run of ``steps`` equals."""
    name = f"reference-{replicas}x{steps}"
    ckpt = ckpt_dir(ns, name)
    t0 = time.monotonic()
    kubectl.apply(fault_job(name, image, ckpt, steps=steps, replicas=replicas), ns)
    done = wait_state(kubectl, ns, name, "Succeeded", 400, operator.tail)
    assert done["status"]["restarts"] == 0
    print(f"undisturbed run of {replicas} workers x {steps} steps: {time.monotonic() - t0:.0f}s")
    return final_weights(ckpt, steps)


def wait_training(
    kubectl, ns, name, operator, ckpt: Path, restarts: dict[str, int] | None = None, timeout_s=300
) -> int:
    """Wait until every member runs with exactly ``restarts`` container restarts (pod name →
    count; none: 2 members, none restarted), then until the chief commits a checkpoint it made
    since (the gang trains again); return that step."""
    restarts = restarts or {f"{name}-worker-{i}": 0 for i in range(2)}

    def restarted():
        cs = container_statuses(kubectl, ns, name)
        return gang_running(kubectl, ns, name, len(restarts)) and all(
            cs[pod].get("restartCount", 0) == n for pod, n in restarts.items()
        )

    wait_for(
        f"every member running after {restarts}",
        restarted,
        timeout_s,
        story(kubectl, ns, name, operator),
        poll_s=0.3,
    )
    since = newest_step(ckpt)
    return wait_for(
        f"a checkpoint after step {since}",
        lambda: newest_step(ckpt) > since and newest_step(ckpt),
        timeout_s,
        story(kubectl, ns, name, operator),
        poll_s=0.2,
    )


def kill_the_operator_repeatedly(
    kubectl, ns, operator, image, kills: int, name: str, steps: int, rng: random.Random
):
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
            seen.append(
                (
                    st.get("state"),
                    (st.get("progress") or {}).get("step"),
                    st.get("restarts", 0),
                    sorted(p["metadata"]["name"] for p in pods),
                    {p["metadata"]["uid"] for p in pods},
                )
            )
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    operator.kill9()
    kubectl.apply(fault_job(name, image, ckpt, steps=steps), ns)
    done_kills, last_at = 0, 0
    try:
        while done_kills < kills:
            operator.start()
            time.sleep(rng.uniform(0, 2.0))
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
    assert last_at < steps, f"the last kill came after training ended ({steps} steps)"
    order = {None: 0, "Created": 1, "Running": 2, "Succeeded": 3}
    progress = [s[1] for s in seen if s[1] is not None]
    assert progress == sorted(progress), "progress went back"
    ranks = [order.get(s[0], -1) for s in seen]
    assert ranks == sorted(ranks), [s[0] for s in seen]
    assert all(s[2] == 0 for s in seen), "a restart was counted"
    assert all(
        s[3]
        in (
            [],
            [f"{name}-worker-0"],
            [f"{name}-worker-0", f"{name}-worker-1"],
            [f"{name}-worker-1"],
        )
        for s in seen
    ), {tuple(s[3]) for s in seen}
    uids = set().union(*(s[4] for s in seen))
    assert len(uids) == 2, "a pod was created twice"
    assert pods_created(kubectl, ns, name) == 2
    assert done["status"]["restarts"] == 0 and done["status"]["progress"]["step"] == steps
    assert newest_step(ckpt) == steps
    print(
        f"{done_kills} operator kills, the last at checkpoint step {last_at} of {steps}; "
        f"{len(seen)} status samples, states "
        f"{sorted({s[0] for s in seen}, key=lambda s: order.get(s, -1))}"
    )
