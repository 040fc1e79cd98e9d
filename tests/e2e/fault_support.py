"""What the fault tests share: one job spec whose every run trains the same steps with the same
checkpoint cadence into a host directory (so the test can read the chief's final weights), the
comparison with an undisturbed run, and the ways to hurt a container from the node: SIGKILL,
SIGSTOP, its network namespace's link."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
from e2e_support import training_job

CTR = ["ctr", "--address", "/run/ringtrain-containerd/containerd.sock", "-n", "k8s.io"]
STEPS = 600
EVERY = 20


def fault_job(name: str, image: str, ckpt: Path, backoff: int = 2, steps: int = STEPS,
              **run_policy) -> dict:
    """The one spec every fault test runs: cleanPodPolicy None keeps the pods to inspect; the
    connect timeout covers the kubelet's growing crash back-off (docs/operator.md)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    ckpt.chmod(0o777)
    return training_job(name, image, steps=steps,
                        run_policy={"cleanPodPolicy": "None", "backoffLimit": backoff,
                                    "activeDeadlineSeconds": 900, **run_policy},
                        checkpoint={"everySteps": EVERY, "volume": {
                            "hostPath": {"path": str(ckpt), "type": "Directory"}}},
                        ring={"connectTimeoutSeconds": 300})


def committed_steps(ckpt: Path) -> list[int]:
    """Steps of the checkpoints whose manifest (the commit record) is written."""
    out = []
    for f in ckpt.glob("ckpt-*.json"):
        try:
            out.append(json.loads(f.read_text())["step"])
        except (OSError, ValueError, KeyError):
            pass  # pruned or being replaced under us
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
            f"{k}: max |diff| {np.max(np.abs(got[k] - want[k]))}")


def container_id(kubectl, ns: str, pod: str) -> str:
    p = kubectl.json("get", "pod", pod, "-n", ns)
    return p["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]


def ctr_kill(cid: str, sig: str = "SIGKILL") -> None:
    subprocess.run([*CTR, "tasks", "kill", "-s", sig, cid], check=True, capture_output=True,
                   timeout=30)


def host_pids(cid: str) -> list[int]:
    """The container's processes as the node sees them (its init and every descendant)."""
    out = subprocess.run([*CTR, "tasks", "ls"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    root = next(int(line.split()[1]) for line in out.splitlines() if line.startswith(cid))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class NetNS:
    """A pod's network namespace, held open by a file descriptor: it outlives the container
    process it was found through (that one exits and is restarted while the link is down)."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)

    def ip(self, *args: str, check: bool = True) -> None:
        subprocess.run(["nsenter", f"--net=/proc/{os.getpid()}/fd/{self.fd}", "ip", *args],
                       check=check, capture_output=True, timeout=30, pass_fds=(self.fd,))

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
    return {p["metadata"]["name"]: (p["status"].get("containerStatuses") or [{}])[0]
            for p in pods}


def gang_running(kubectl, ns: str, name: str, n: int = 2) -> bool:
    cs = container_statuses(kubectl, ns, name)
    return len(cs) == n and all("running" in (c.get("state") or {}) for c in cs.values())


def progress_steps(kubectl, ns: str, pod: str, previous: bool = False) -> list[int]:
    """The steps of the chief's progress lines in its current (or previous) container's log."""
    args = ["logs", pod, "-n", ns, "-c", "ringtrain"] + (["--previous"] if previous else [])
    log = kubectl(*args, check=False).stdout
    return [json.loads(line)["step"] for line in log.splitlines()
            if line.startswith("{") and '"progress"' in line]


def final_event(kubectl, ns: str, pod: str) -> dict:
    st = kubectl.json("get", "pod", pod, "-n", ns)["status"]["containerStatuses"][0]
    return json.loads(st["state"]["terminated"]["message"])


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))
