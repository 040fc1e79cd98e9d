"""Helpers shared by the operator's end-to-end tests: TrainingJob manifests, the operator as a
separate process (exactly `ringtrain operator`), and polling with deadlines that fails with the
whole story (the job, its pods, their logs, events, the operator's log) instead of a bare timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support import procs
from support.ports import free_port
from support.procs import CLI

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "operator" / "ringtrain_operator" / "crd" / "trainingjobs.yaml"
CHART = REPO / "charts" / "ringtrain"
OPERATOR_READY_S = 60
POLL_S = 0.25


def training_job(
    name: str,
    image: str,
    replicas: int = 2,
    steps: int = 20,
    run_policy: dict | None = None,
    **trainer: Any,
) -> dict:
    """A small TrainingJob of the built-in trainer on mnist-5k (fast on two cores)."""
    return {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "terminationGracePeriodSeconds": 5,
                            "containers": [
                                {
                                    "name": "ringtrain",
                                    "image": image,
                                    "imagePullPolicy": "Never",
                                    "resources": {"requests": {"cpu": "10m"}},
                                }
                            ],
                        }
                    },
                }
            },
            "trainer": {"dataset": "mnist-5k", "steps": steps, "batchSize": 32, **trainer},
            "runPolicy": {"backoffLimit": 1, "activeDeadlineSeconds": 600, **(run_policy or {})},
        },
    }


def sleep_job(
    name: str, image: str, replicas: int = 2, seconds: int = 3600, run_policy: dict | None = None
) -> dict:
    """A job of real, running but idle pods (the user-command path, no spec.trainer)."""
    return {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            # sleep as PID 1 ignores SIGTERM: do not wait 30 s for every deletion.
                            "terminationGracePeriodSeconds": 1,
                            "containers": [
                                {
                                    "name": "ringtrain",
                                    "image": image,
                                    "imagePullPolicy": "Never",
                                    "command": ["sleep", str(seconds)],
                                    "resources": {"requests": {"cpu": "1m"}},
                                }
                            ],
                        }
                    },
                }
            },
            "runPolicy": {"backoffLimit": 1, **(run_policy or {})},
        },
    }


def wait_http_ok(
    what: str, proc: subprocess.Popen, url: str, timeout_s: float, tail: Callable[[], str]
) -> None:
    """Poll ``url`` until it answers 200; fail at once with ``tail()`` if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{tail()}", pytrace=False)
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} not answering {url} after {timeout_s}s:\n{tail()}", pytrace=False)


class OperatorProcess:
    """`ringtrain operator --kubeconfig ... -n NS` as a child process, restartable and killable."""

    def __init__(self, kubeconfig: str, namespaces: list[str], log: Path) -> None:
        self.kubeconfig, self.namespaces, self.log = kubeconfig, namespaces, log
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> OperatorProcess:
        self.port = free_port()
        ns_args = [a for ns in self.namespaces for a in ("-n", ns)]
        with open(self.log, "a") as out:
            out.write(f"\n===== operator start {time.strftime('%H:%M:%S')} =====\n")
            out.flush()
            self.proc = subprocess.Popen(
                [
                    *CLI,
                    "operator",
                    "--kubeconfig",
                    self.kubeconfig,
                    *ns_args,
                    "--listen",
                    f"127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        wait_http_ok(
            "operator",
            self.proc,
            f"http://127.0.0.1:{self.port}/healthz",
            OPERATOR_READY_S,
            self.tail,
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, timeout_s=30)

    def tail(self, chars: int = 8000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no operator log: {e})"


def job_story(kubectl, ns: str, name: str, operator_log: Callable[[], str] | None = None) -> str:
    """Everything needed to see why a job did not get where a test expected."""
    parts = []
    for args in (
        ("get", "tj", name, "-n", ns, "-o", "yaml"),
        ("get", "pods,svc,secrets", "-n", ns, "-o", "wide", "-l", f"ringtrain.io/job-name={name}"),
        ("describe", "pods", "-n", ns, "-l", f"ringtrain.io/job-name={name}"),
        (
            "logs",
            "-n",
            ns,
            "-l",
            f"ringtrain.io/job-name={name}",
            "--tail",
            "15",
            "--prefix",
            "--all-containers",
        ),
        ("get", "events", "-n", ns, "--sort-by", ".lastTimestamp"),
    ):
        p = kubectl(*args, check=False)
        parts.append(f"--- kubectl {' '.join(args)}\n{p.stdout[-6000:]}{p.stderr[-2000:]}")
    if operator_log is not None:
        parts.append(f"--- operator log\n{operator_log()}")
    return "\n".join(parts)


def newest_checkpoint_step(kubectl, ns: str, pod: str) -> int | None:
    """The step of the newest checkpoint in the pod's own (emptyDir) checkpoint volume."""
    code = (
        "import glob, json; s = [json.load(open(f))['step'] for f in "
        "glob.glob('/checkpoints/ckpt-*.json')]; print(max(s) if s else '')"
    )
    p = kubectl("exec", pod, "-n", ns, "-c", "ringtrain", "--", "python", "-c", code, check=False)
    out = p.stdout.strip()
    return int(out) if p.returncode == 0 and out.isdigit() else None


def get_job(kubectl, ns: str, name: str) -> dict | None:
    return kubectl.json("get", "tj", name, "-n", ns, missing_ok=True)


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout_s: float,
    story: Callable[[], str],
    poll_s: float = POLL_S,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``story()`` at the deadline.
    ``check`` may raise ``Unexpected`` to fail at once (e.g. a job went terminal the wrong way)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            last = check()
        except Unexpected as e:
            pytest.fail(f"{what}: {e}\n{story()}", pytrace=False)
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s}s waiting for {what}\n{story()}", pytrace=False
            )
        time.sleep(poll_s)


class Unexpected(Exception):
    pass


def wait_state(
    kubectl,
    ns: str,
    name: str,
    state: str,
    timeout_s: float,
    operator_log: Callable[[], str] | None = None,
    reason: str | None = None,
    observe: Callable[[], None] | None = None,
) -> dict:
    """Wait for status.state (and the condition's reason); a different terminal state fails.
    ``observe`` runs at every poll, to record what the cluster forgets (container exits)."""

    def check():
        if observe is not None:
            observe()
        job = get_job(kubectl, ns, name)
        st = (job or {}).get("status") or {}
        got = st.get("state")
        if got == state:
            if reason is None:
                return job
            cond = next((c for c in st.get("conditions", []) if c["type"] == state), {})
            if cond.get("reason") == reason:
                return job
        if got in ("Succeeded", "Failed") and got != state:
            raise Unexpected(f"job {ns}/{name} is {got}, expected {state}")
        return None

    return wait_for(
        f"TrainingJob {ns}/{name} to be {state}" + (f" ({reason})" if reason else ""),
        check,
        timeout_s,
        lambda: job_story(kubectl, ns, name, operator_log),
    )


def job_pods(kubectl, ns: str, name: str, include_deleting: bool = True) -> list[dict]:
    items = kubectl.json("get", "pods", "-n", ns, "-l", f"ringtrain.io/job-name={name}")["items"]
    return [p for p in items if include_deleting or not p["metadata"].get("deletionTimestamp")]


@contextmanager
def fresh_namespace(kubectl, prefix: str) -> Iterator[str]:
    """A fresh namespace (its default ServiceAccount there, so pods are admitted) with the CRD
    applied and Established; deleted, without waiting, afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: kubectl.json("get", "sa", "default", "-n", name, missing_ok=True) is not None,
        60,
        lambda: "",
    )
    kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.ringtrain.io", "--timeout=60s")
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)
