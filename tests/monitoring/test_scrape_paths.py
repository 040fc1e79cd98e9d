"""The chart's dashboard and alert rules work however Prometheus scrapes ringtrain.

A real two-worker ``ringtrain run`` trains while two real Prometheus servers (Debian's) scrape it,
one through the chart's annotation scrape config (``prometheus/scrape-configs.yaml``), one through
the chart's PodMonitor as the Prometheus Operator turns it into a scrape config. The targets are
the Pods ``ringtrain render`` prints for two jobs — ``alpha`` and ``beta`` in one namespace, both
pointing at the same two worker processes — so a panel that ignored ``job_name`` would show
both. The operator's real ``/metrics`` app is scraped as the chart's Deployment pod.

In both setups every query of every dashboard panel, its variables set to one job, returns data
of that job alone; every alert rule evaluates healthy; ``promtool check metrics`` finds nothing
to say about either component's payload. No cluster needed.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from monitoring_support import (
    DASHBOARD,
    SNIPPET,
    Prometheus,
    annotation_job,
    fetch,
    helm_template,
    operator_pod,
    podmonitor_job,
    prometheus_config,
    promtool_check_metrics,
    render_pods,
    running_on_loopback,
    start_prometheus,
    write_file_sd,
)
from prometheus_client import CollectorRegistry
from support.ports import free_port
from support.procs import CLI, stop

from ringtrain_operator import main as operator_main
from ringtrain_operator import spec as jobspec
from ringtrain_operator import status
from ringtrain_operator.metrics import OperatorMetrics
from ringtrain_trainer.ipu.memory import KINDS

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "team-a"
JOBS = ("alpha", "beta")
DEADLINE_S = 90
TARGET_LABELS = {"namespace", "pod", "job_name", "role", "index"}


def job_manifest(name: str) -> dict:
    """A two-worker job that trains until the test stops it."""
    return {
        "apiVersion": jobspec.API_VERSION,
        "kind": jobspec.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicaSpecs": {"Worker": {"replicas": 2}},
            "trainer": {
                "dataset": "mnist-5k",
                "steps": 1_000_000,
                "batchSize": 16,
                "evalEvery": 20,
            },
        },
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("monitoring")


@pytest.fixture(scope="module")
def training(workdir):
    """``ringtrain run`` of job alpha; yields {replica label: metrics port}."""
    manifest = workdir / "alpha.yaml"
    manifest.write_text(yaml.safe_dump(job_manifest("alpha")))
    with open(workdir / "run.stderr", "w") as log:
        drain = threading.Thread()
        proc = subprocess.Popen(
            [
                *CLI,
                "run",
                str(manifest),
                "--json",
                "--run-dir",
                str(workdir / "run"),
                "--progress-interval",
                "3600",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=workdir,
        )
        try:
            start = json.loads(proc.stdout.readline() or "{}")
            assert start.get("event") == "start", (start, (workdir / "run.stderr").read_text())
            drain = threading.Thread(target=proc.stdout.read, daemon=True)  # keep the pipe flowing
            drain.start()
            yield {label: r["metrics_port"] for label, r in start["replicas"].items()}
        finally:
            stop(proc, timeout_s=30)
            if drain.ident:
                drain.join(10)
            proc.stdout.close()


@pytest.fixture(scope="module")
def operator_port():
    """The operator's own /metrics app (main.health_app) on a free port, its registry fed as the
    reconciler feeds it: a record and a reconcile duration per pass, every 0.2 s."""
    metrics = OperatorMetrics(CollectorRegistry())
    created = status.Decision(
        status={"state": status.RUNNING},
        events=(status.Event("Normal", status.REASON_CREATED, "created"),),
    )
    for ns in (NAMESPACE, "team-b"):
        for reason in (
            status.REASON_CREATED,
            status.REASON_RESTARTING,
            status.REASON_SUCCEEDED,
            status.REASON_FAILED,
        ):
            metrics.record(
                ns,
                "alpha",
                status.Decision(status={}, events=(status.Event("Normal", reason, reason),)),
            )
    port, stop, ready = free_port(), threading.Event(), threading.Event()

    async def serve():
        runner = web.AppRunner(operator_main.health_app(metrics))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            started = time.perf_counter()
            metrics.record(NAMESPACE, "alpha", created)
            metrics.reconcile_seconds.observe(time.perf_counter() - started + 0.003)
            await asyncio.sleep(0.2)
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield port
    stop.set()
    thread.join(10)


@pytest.fixture(scope="module")
def targets(workdir, training, operator_port):
    """file SD files: the workers of both jobs (the same processes), and the operator pod."""
    pods = []
    for name in JOBS:
        manifest = workdir / f"{name}-render.yaml"
        manifest.write_text(yaml.safe_dump(job_manifest(name)))
        for pod in render_pods(manifest, NAMESPACE):
            label = (
                f"{pod['metadata']['labels']['ringtrain.io/replica-type']}-"
                f"{pod['metadata']['labels']['ringtrain.io/replica-index']}"
            )
            pods.append(running_on_loopback(pod, training[label]))
    (deployment,) = [o for o in helm_template() if o["kind"] == "Deployment"]
    return {
        "workers": write_file_sd(workdir / "workers.json", pods),
        "operator": write_file_sd(
            workdir / "operator.json", [operator_pod(deployment, operator_port)]
        ),
    }


@pytest.fixture(scope="module")
def prometheis(workdir, targets):
    """Both scrape paths at once (they share the deadline and the two cores)."""
    (pm,) = [
        o
        for o in helm_template("--set", "metrics.podMonitor.enabled=true")
        if o["kind"] == "PodMonitor"
    ]
    setups = {
        "annotations": [annotation_job([targets["workers"], targets["operator"]])],
        # The PodMonitor for the workers; the operator still by the chart's default annotations.
        "podmonitor": [
            podmonitor_job(pm, [targets["workers"]]),
            annotation_job([targets["operator"]]),
        ],
    }
    proms = {
        name: start_prometheus(prometheus_config(jobs), workdir / name)
        for name, jobs in setups.items()
    }
    yield proms
    for prom in proms.values():
        prom.stop()


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"namespace", "job_name"} <= names
    return [
        (p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]
    ]


def substitute(expr: str, job: str) -> str:
    return expr.replace("$namespace", NAMESPACE).replace("$job_name", job)


def check_panels(prom: Prometheus, job: str) -> list[str] | None:
    """None until every panel query has data; then the problems with it (empty: none)."""
    problems = []
    for title, expr in panel_queries():
        result = prom.query(substitute(expr, job))
        if not result:
            return None
        for series in result:
            labels, value = series["metric"], series["value"]
            if "$job_name" in expr and (labels.get("job_name"), labels.get("namespace")) != (
                job,
                NAMESPACE,
            ):
                problems.append(f"{title}: {expr}\n  leaked {labels}")
            if (
                "$job_name" not in expr
                and "$namespace" in expr
                and labels.get("job_namespace") != NAMESPACE
            ):
                problems.append(f"{title}: {expr}\n  leaked {labels}")
            if math.isnan(value):
                return None  # a rate over one sample; the next scrape fills it
    return problems


@pytest.mark.parametrize("path", ["annotations", "podmonitor"])
def test_every_panel_shows_one_job_and_every_rule_is_healthy(prometheis, path):
    prom = prometheis[path]
    deadline = time.monotonic() + DEADLINE_S

    def all_up():
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        return active if len(active) == 5 and all(t["health"] == "up" for t in active) else None

    active = prom.until("4 worker targets and the operator to be up", all_up, deadline)
    for t in active:
        labels = set(t["labels"]) - {"job", "instance", "container", "endpoint"}
        expected = TARGET_LABELS if "job_name" in t["labels"] else {"namespace", "pod"}
        assert labels == expected, t["labels"]
    workers = [t["labels"] for t in active if "job_name" in t["labels"]]
    assert sorted((w["job_name"], w["role"], w["index"], w["pod"]) for w in workers) == [
        (j, "worker", str(i), f"{j}-worker-{i}") for j in JOBS for i in range(2)
    ]

    # The dashboard's variables offer both jobs of the namespace.
    values = prom.get(
        "/api/v1/label/job_name/values",
        **{"match[]": f'ringtrain_steps_total{{namespace=~"{NAMESPACE}"}}'},
    )
    assert sorted(values) == sorted(JOBS)
    assert NAMESPACE in prom.get(
        "/api/v1/label/namespace/values", **{"match[]": "ringtrain_steps_total"}
    )

    for job in JOBS:
        problems = prom.until(
            f"every panel of job {job} to have data",
            lambda job=job: check_panels(prom, job),
            deadline,
        )
        assert problems == [], "\n".join(problems)
        # the stacked memory panel has one series per kind, each the training program's plan
        stacked = [e for t, e in panel_queries() if t == "IPU memory by kind (per IPU)"]
        kinds = {r["metric"]["kind"]: r["value"] for r in prom.query(substitute(stacked[0], job))}
        assert sorted(kinds) == sorted(KINDS) and kinds["weights"] > 0, kinds

    def rules_evaluated():
        groups = prom.get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
        return rules if rules and done else None

    rules = prom.until("every rule to be evaluated", rules_evaluated, deadline)
    source = yaml.safe_load((ROOT / "charts/ringtrain/rules/ringtrain.rules.yaml").read_text())
    assert len(rules) == sum(len(g["rules"]) for g in source["groups"])
    assert [(r["name"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
    # Workers that train are not stalled, an operator is scraped.
    assert {r["name"]: r["state"] for r in rules}["RingtrainWorkerStalled"] == "inactive"
    assert {r["name"]: r["state"] for r in rules}["RingtrainOperatorDown"] == "inactive"


def test_promtool_finds_nothing_in_the_worker_and_operator_payloads(training, operator_port):
    for url in [f"http://127.0.0.1:{port}/metrics" for port in training.values()] + [
        f"http://127.0.0.1:{operator_port}/metrics"
    ]:
        payload = fetch(url)
        assert "ringtrain_" in payload
        assert promtool_check_metrics(payload) == "", url


def test_the_e2e_prometheus_uses_the_charts_relabel_rules():
    (job,) = yaml.safe_load(SNIPPET.read_text())
    e2e = yaml.safe_load((ROOT / "tests/e2e/prometheus/prometheus.yml").read_text())
    (e2e_job,) = e2e["scrape_configs"]
    assert e2e_job["relabel_configs"] == job["relabel_configs"]
