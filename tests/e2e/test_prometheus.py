"""A real Prometheus finds and scrapes ringtrain's pods on the real local cluster.

Debian's Prometheus runs on the host. Debian builds it without Kubernetes discovery, so the pods
reach it over ``http_sd_configs`` from ``support/pod_discovery.py``, which lists them from
this cluster's API server as a ServiceAccount the test creates with nothing but get/list/watch
on pods in the test's namespace (what an in-cluster Prometheus would hold), TLS verified with the
cluster's CA, and labels them exactly as Prometheus' ``kubernetes_sd_configs`` (role: pod) does.
The standard ``prometheus.io/*`` annotation relabeling (``prometheus/prometheus.yml``, checked
with ``promtool check config``) and the scraping are Prometheus' own. Scraped, from the project
image:
  - a training worker whose Pod (and Service and Secret) come from the operator's own pure
    ``manifests.desired_objects()``, so annotations and ports are exactly what the operator
    creates; it trains Fashion-MNIST until the test has what it needs, then is deleted;
  - the operator, installed with the Helm chart (namespaced RBAC) and annotated through
    the chart's default ``metrics.scrapeAnnotations``; a suspended TrainingJob gives it
    something to count.
Everything is asserted through Prometheus' HTTP API: both targets discovered and ``up == 1``,
real series with sane values. Failures carry Prometheus' log, its /api/v1/targets, the
discovery endpoint's state, the pods and their logs.
"""

from __future__ import annotations

import base64
import json
import math
import string
import time
from pathlib import Path

import pytest
import yaml
from e2e_support import training_job
from support.pod_discovery import PodDiscovery, target_groups
from support.prometheus import Prometheus, check_config

from ringtrain_operator import __version__ as OPERATOR_VERSION
from ringtrain_operator import manifests, spec

pytestmark = pytest.mark.e2e

CONFIG_TEMPLATE = Path(__file__).parent / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL_S = 2
JOB = "fmnist"  # the worker's TrainingJob name (its pod: fmnist-worker-0)

SA = "prometheus"
DEADLINE_S = 150
POLL_S = 0.5


# --------------------------------------------------------------------------- the scraper's identity


@pytest.fixture
def scraper_token(kubectl, namespace) -> str:
    """A ServiceAccount allowed only to get/list/watch pods in the namespace; its token."""
    kubectl.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": SA},
                "rules": [
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": SA},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
                "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": namespace}],
            },
        ],
        namespace,
    )
    who = f"system:serviceaccount:{namespace}:{SA}"

    def can(*args: str) -> bool:
        return kubectl("auth", "can-i", "--as", who, *args, check=False).stdout.strip() == "yes"

    # Kubernetes 1.20: the token controller puts a long-lived token in a Secret of the SA.
    deadline = time.monotonic() + 30
    while True:
        sa = kubectl.json("get", "serviceaccount", SA, "-n", namespace)
        token = None
        if sa.get("secrets"):
            secret = kubectl.json("get", "secret", sa["secrets"][0]["name"], "-n", namespace)
            token = secret.get("data", {}).get("token")
        if token and can("watch", "pods", "-n", namespace):  # the binding is in force
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"no token Secret or no pod access for ServiceAccount {namespace}/{SA} "
                f"after 30s:\n{json.dumps(sa, indent=1)}",
                pytrace=False,
            )
        time.sleep(0.2)
    assert can("list", "pods", "-n", namespace)
    assert not can("list", "pods", "-n", "default")
    assert not can("get", "secrets", "-n", namespace)
    assert not can("create", "pods", "-n", namespace)
    return base64.b64decode(token).decode()


# --------------------------------------------------------------------------- Prometheus on the host


def cluster_access(kubeconfig: str, workdir: Path) -> tuple[str, str]:
    """The API server's URL and a file with the cluster's CA, from the kubeconfig."""
    cluster = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]
    ca = workdir / "ca.crt"
    ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    return cluster["server"], str(ca)


def render_config(discovery_url: str, workdir: Path) -> Path:
    text = string.Template(CONFIG_TEMPLATE.read_text()).safe_substitute(
        POD_DISCOVERY_URL=discovery_url,
        SCRAPE_INTERVAL=f"{SCRAPE_INTERVAL_S}s",
        SCRAPE_TIMEOUT=f"{SCRAPE_INTERVAL_S}s",
    )
    assert "${" not in text, text
    config = workdir / "prometheus.yml"
    config.write_text(text)
    return config


@pytest.fixture
def pod_discovery(kubeconfig, namespace, scraper_token, tmp_path):
    """Kubernetes pod discovery as the scraper's ServiceAccount (see support/pod_discovery)."""
    api_server, ca = cluster_access(kubeconfig, tmp_path)
    with PodDiscovery(api_server, ca, scraper_token, [namespace]) as sd:
        yield sd


@pytest.fixture
def prometheus(pod_discovery, tmp_path):
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    config = render_config(pod_discovery.url, workdir)
    check_config(config)
    prom = Prometheus(config, workdir, "--storage.tsdb.retention.time=1h", "--log.level=debug")
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()
        print(f"--- prometheus log (tail)\n{prom.tail(3000)}")


# --------------------------------------------------------------------------- what gets scraped


@pytest.fixture
def parked_job(kubectl, namespace, project_image, operator_release):
    """A suspended TrainingJob: something for the operator's gauges and histogram to count.
    Deleted while the operator still runs, so that it can remove its finalizer."""
    kubectl.apply(
        training_job("parked", project_image, replicas=1, steps=5, run_policy={"suspend": True}),
        namespace,
    )
    try:
        yield "parked"
    finally:
        kubectl("delete", "tj", "parked", "-n", namespace, "--timeout=30s", check=False)


def worker_objects(namespace: str, image: str) -> list[dict]:
    """The operator's own Service, Secret and worker Pod for a 1-worker Fashion-MNIST job that
    trains far longer than the test needs (the test deletes it)."""
    tj = training_job(
        JOB, image, replicas=1, steps=1_000_000, dataset="fashion-mnist", batchSize=64
    )
    tj["metadata"]["namespace"] = namespace
    return manifests.desired_objects(spec.load(tj))


@pytest.fixture
def worker(kubectl, namespace, project_image, wait_pod):
    objs = worker_objects(namespace, project_image)
    pod = objs[-1]
    assert pod["kind"] == "Pod" and pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    kubectl.apply(objs, namespace)
    try:
        yield wait_pod(namespace, pod["metadata"]["name"], ("Running",), 120)
    finally:
        kubectl(
            "delete", "pod", pod["metadata"]["name"], "-n", namespace, "--wait=false", check=False
        )


def cluster_story(kubectl, namespace: str) -> str:
    parts = []
    for args in (
        ("get", "pods", "-n", namespace, "-o", "wide", "--show-labels"),
        ("describe", "pods", "-n", namespace),
        ("logs", "-n", namespace, f"{JOB}-worker-0", "--tail", "20"),
        ("logs", "-n", namespace, "deploy/rt-ringtrain", "--tail", "40"),
        ("get", "events", "-n", namespace, "--sort-by", ".lastTimestamp"),
    ):
        r = kubectl(*args, check=False)
        parts.append(f"--- kubectl {' '.join(args)}\n{r.stdout[-5000:]}{r.stderr[-1000:]}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- the test


def test_prometheus_discovers_and_scrapes_the_worker_and_the_operator(
    kubectl, namespace, pod_discovery, prometheus, worker, operator_release, parked_job
):
    prom = prometheus

    def story() -> str:
        return (
            f"{cluster_story(kubectl, namespace)}\n--- pod discovery: "
            f"{pod_discovery.requests} requests from Prometheus, last error: "
            f"{pod_discovery.last_error}\n--- prometheus /api/v1/targets\n"
            f"{prom.targets_json()}\n--- prometheus log\n{prom.tail()}"
        )

    deadline = time.monotonic() + DEADLINE_S

    def until(what: str, check):
        last = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except (OSError, ValueError) as e:  # Prometheus API hiccup: keep polling
                last = e
            if last and not isinstance(last, Exception):
                return last
            time.sleep(POLL_S)
        pytest.fail(f"timed out waiting for {what} (last: {last!r})\n{story()}", pytrace=False)

    pods = {
        p["metadata"]["name"]: p
        for p in kubectl.json("get", "pods", "-n", namespace)["items"]
        if not p["metadata"].get("deletionTimestamp")
    }
    worker_name = worker["metadata"]["name"]
    (operator_pod,) = [
        p for n, p in pods.items() if n.startswith(operator_release.deployment + "-")
    ]
    operator_name = operator_pod["metadata"]["name"]
    expected = {
        worker_name: f"http://{worker['status']['podIP']}:{manifests.METRICS_PORT}/metrics",
        operator_name: f"http://{operator_pod['status']['podIP']}:8080/metrics",
    }

    # 1. Discovery through the API server as the least-privileged ServiceAccount; both up.
    def both_targets_up():
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        ours = {t["labels"].get("pod"): t for t in active}
        if all(ours.get(n, {}).get("health") == "up" for n in expected):
            return ours
        return None

    targets = until("both pods to be discovered and scraped healthy", both_targets_up)
    assert set(targets) == set(expected), f"unexpected targets:\n{prom.targets_json()}"
    for name, url in expected.items():
        t = targets[name]
        assert t["scrapeUrl"] == url, t
        assert t["labels"]["namespace"] == namespace and t["labels"]["job"] == "ringtrain-pods"
        assert (
            t["discoveredLabels"]["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] == "true"
        )
    # The chart's target labels (charts/ringtrain/prometheus/scrape-configs.yaml).
    assert targets[worker_name]["labels"]["job_name"] == JOB
    assert targets[worker_name]["labels"]["role"] == "worker"
    assert targets[worker_name]["labels"]["index"] == "0"
    assert "job_name" not in targets[operator_name]["labels"]
    up = {s["metric"]["pod"]: s["value"] for s in prom.query(f'up{{namespace="{namespace}"}}')}
    assert up == {worker_name: 1.0, operator_name: 1.0}, up

    # 2. The worker's training series, scraped while it trains.
    sel = f'{{namespace="{namespace}",pod="{worker_name}"}}'

    def one(promql: str) -> float | None:
        vec = prom.query(promql)
        return vec[0]["value"] if len(vec) == 1 else None

    def training_is_scraped():
        # Two scrapes that both saw steps, the later more: the worker is training right now.
        data = prom.get("/api/v1/query", query=f"ringtrain_steps_total{sel}[1m]")["result"]
        values = [float(v) for _, v in data[0]["values"]] if data else []
        seen = [v for v in values if v > 0]
        return values if len(seen) >= 2 and values[-1] > seen[0] else None

    steps = until("ringtrain_steps_total of the worker to grow across scrapes", training_is_scraped)
    assert steps == sorted(steps), f"a counter went down: {steps}"
    count = one(f"ringtrain_step_duration_seconds_count{sel}")
    total = one(f"ringtrain_step_duration_seconds_sum{sel}")
    assert count is not None and count >= steps[-1] > 0, (count, steps)
    assert 0 < total / count < 10, f"mean step {total / count} s"
    loss = one(f"ringtrain_loss{sel}")
    assert loss is not None and math.isfinite(loss) and 0 < loss < 10, loss
    assert (one(f"ringtrain_samples_per_second{sel}") or 0) > 0
    memory = one(f"sum without (kind) (ringtrain_ipu_memory_bytes{sel})")
    capacity = one(f"ringtrain_ipu_memory_capacity_bytes{sel}")
    assert capacity == 900 * 2**20 or capacity == 900 * 10**6, capacity
    assert memory is not None and 0 < memory <= capacity, (memory, capacity)
    data_in = one(
        f'ringtrain_ipu_stream_bytes_total{{namespace="{namespace}",'
        f'pod="{worker_name}",direction="data_in"}}'
    )
    assert data_in is not None and data_in >= count * 64 * 28 * 28, (data_in, count)

    # 3. The operator's own series, from the chart's pod.
    osel = f'{{namespace="{namespace}",pod="{operator_name}"}}'
    info = prom.query(f"ringtrain_operator_info{osel}")
    assert [(s["metric"]["version"], s["value"]) for s in info] == [(OPERATOR_VERSION, 1.0)], info
    until(
        "the operator to report the suspended job and a reconcile",
        lambda: (
            one(
                f'ringtrain_operator_jobs{{namespace="{namespace}",pod="{operator_name}",'
                f'state="Suspended"}}'
            )
            == 1.0
            and (one(f"ringtrain_operator_reconcile_duration_seconds_count{osel}") or 0) > 0
        ),
    )
    states = {
        s["metric"]["state"]: s["value"] for s in prom.query(f"ringtrain_operator_jobs{osel}")
    }
    assert states["Suspended"] == 1.0 and states["Running"] == 0.0, states


def test_pod_discovery_labels_a_pod_as_kubernetes_sd_does():
    """The labels the relabel rules read, for the operator's own worker pod."""
    pod = worker_objects("ns1", "ringtrain:test")[-1]
    pod["status"] = {
        "phase": "Running",
        "podIP": "10.244.0.9",
        "hostIP": "192.0.2.2",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    groups = target_groups([pod, {**pod, "status": {"phase": "Pending"}}])  # no IP: no target
    assert [g["targets"] for g in groups] == [["10.244.0.9:2222"], ["10.244.0.9:9400"]]
    labels = groups[1]["labels"]
    m = "__meta_kubernetes_"
    assert labels[f"{m}pod_annotation_prometheus_io_scrape"] == "true"
    assert labels[f"{m}pod_annotationpresent_prometheus_io_port"] == "true"
    assert labels[f"{m}pod_annotation_prometheus_io_port"] == str(manifests.METRICS_PORT)
    assert labels[f"{m}pod_label_ringtrain_io_job_name"] == JOB
    assert labels[f"{m}pod_container_port_name"] == "metrics"
    assert labels[f"{m}pod_container_port_number"] == "9400"
    assert labels[f"{m}pod_container_init"] == "false"
    assert (
        labels[f"{m}namespace"],
        labels[f"{m}pod_name"],
        labels[f"{m}pod_ready"],
        labels[f"{m}pod_phase"],
    ) == ("ns1", f"{JOB}-worker-0", "true", "Running")
