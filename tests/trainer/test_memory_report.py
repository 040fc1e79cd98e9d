"""The IPU memory report: one compile-time plan, by kind and by layer, in the metrics, ``/status``
and ``ringtrain worker --report``."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from support.procs import WORKER

from ringtrain import events
from ringtrain_trainer import optim as O
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.telemetry.metrics import TrainerMetrics


def plan(name="cnn", opt="sgd", on_host=True, batch=64, train=True, replicas=1):
    spec = keras_load.build(name)
    params = spec.init(0)
    ipu = IPU(
        spec,
        IPUConfig(
            variables_on_host=on_host,
            replicas=replicas,
            optimizer_state_bytes=O.state_bytes_for(opt, spec.num_params),
        ),
        params,
        np.zeros_like(params),
    )
    return ipu.compile(batch, train).plan


@pytest.mark.parametrize("name", ["cnn", "cnn2"])
@pytest.mark.parametrize(
    "opt,on_host,train", [("sgd", True, True), ("adam", False, True), ("momentum", False, False)]
)
def test_kinds_add_up_to_the_total_and_layers_to_the_kinds(name, opt, on_host, train):
    p = plan(name, opt, on_host, train=train)
    assert tuple(p.kinds()) == memory.KINDS
    assert sum(p.kinds().values()) == p.total > 0
    spec = keras_load.build(name)
    names = [r.name for r in p.by_layer]
    assert names == [layer.name for layer in spec.layers] + [memory.INPUT_ROW, memory.LOSS_ROW]
    for kind in memory.KINDS:
        assert sum(getattr(r, kind) for r in p.by_layer) == getattr(p, kind), kind
    assert sum(r.total for r in p.by_layer) == p.total
    # each layer's weights are its own parameters (the rows after them: input and loss); the
    # input row holds the data alone
    item = 4
    for (lo, hi), row in zip(spec.layer_ranges, p.by_layer[:-2], strict=True):
        assert row.weights == (hi - lo) * item
        assert row.gradients == (row.weights if train else 0)
    assert p.by_layer[-2].data == p.data and p.data > 0
    assert dict(p.layers) == {r.name: r.total for r in p.by_layer[:-2]}  # the OOM error's list


def test_optimizer_state_is_on_the_ipu_only_without_variables_on_host():
    n = keras_load.build("cnn").num_params
    # with variables on the host the IPU holds the same bytes whatever the optimizer
    assert plan(opt="sgd") == plan(opt="momentum") == plan(opt="adam")
    assert plan(opt="adam").optimizer_state == 0
    # resident: Adam's two slots and momentum's one, plain SGD none
    sgd, mom, adam = (plan(opt=o, on_host=False) for o in ("sgd", "momentum", "adam"))
    assert sgd.optimizer_state == 0 and sgd.total == plan(opt="sgd").total
    assert mom.optimizer_state == n * 4 and adam.optimizer_state == 2 * n * 4
    assert adam.total - sgd.total == 2 * n * 4
    # ... shared out to the layers by their parameters
    spec = keras_load.build("cnn")
    for (lo, hi), row in zip(spec.layer_ranges, adam.by_layer[:-2], strict=True):
        assert row.optimizer_state == 2 * (hi - lo) * 4
    # an evaluation program never holds optimizer state
    assert plan(opt="adam", on_host=False, train=False).optimizer_state == 0


def test_host_optimizer_state_is_the_complement():
    assert memory.host_optimizer_state(True, 800) == 800
    assert memory.host_optimizer_state(False, 800) == 0


def test_metric_children_exist_at_start_up_and_follow_the_plan():
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    get = registry.get_sample_value
    for kind in memory.KINDS:  # before any plan: every panel's query has data
        assert get("ringtrain_ipu_memory_bytes", {"kind": kind}) == 0.0
    assert get("ringtrain_host_memory_bytes", {"kind": "optimizer_state"}) == 0.0
    assert "ipu_memory" not in metrics.status()  # left out while empty: /status keeps its bytes
    p = plan(opt="adam", on_host=False)
    metrics.set_plan(p, 0)
    for kind, n in p.kinds().items():
        assert get("ringtrain_ipu_memory_bytes", {"kind": kind}) == n
    assert get("ringtrain_ipu_memory_capacity_bytes") == p.capacity
    doc = metrics.status()["ipu_memory"]
    assert doc["kinds"] == p.kinds() and doc["total"] == p.total == sum(doc["kinds"].values())
    assert [r["name"] for r in doc["layers"]] == [r.name for r in p.by_layer]
    assert doc["host"] == {"optimizer_state": 0}
    assert events.Status.from_dict(metrics.status()).ipu_memory == doc
    metrics.set_plan(plan(opt="adam"), 1234)
    assert get("ringtrain_host_memory_bytes", {"kind": "optimizer_state"}) == 1234
    assert get("ringtrain_ipu_memory_bytes", {"kind": "optimizer_state"}) == 0


def test_replicas_plan_each_ipu_for_its_share_of_the_batch():
    assert plan(batch=64, replicas=2) == plan(batch=32)


def _report(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *WORKER,
            "--report",
            "--termination-log",
            "",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_report_prints_every_kind_and_layer_and_exits_without_training():
    out = _report(
        "--model",
        "cnn2",
        "--optimizer",
        "adam",
        "--no-variables-on-host",
        "--batch-size",
        "32",
        "--data-dir",
        "/nonexistent",
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "step" not in text and "done:" not in text  # no training, no data
    p = plan("cnn2", "adam", on_host=False, batch=32)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    for kind, n in p.kinds().items():
        assert rows[kind][0] == f"{n:,}", kind
        assert rows[kind][2].endswith("%")
    assert rows["total"][0] == f"{p.total:,}" and rows["capacity"][0] == f"{900 * MB:,}"
    assert "state on the IPU" in text and "host: optimizer_state 0 bytes" in text
    for r in p.by_layer:
        assert rows[r.name][-2] == f"{r.total:,}", r.name
        assert rows[r.name][:6] == [f"{getattr(r, k):,}" for k in memory.KINDS]


def test_report_of_a_program_that_does_not_fit_prints_the_table_then_fails():
    out = _report("--ipu-memory-mb", "5")
    assert out.returncode != 0
    assert "optimizer_state" in out.stdout and "conv2d+max_pooling2d" in out.stdout
    assert "IPUCompileError" in out.stderr and "does not fit" in out.stderr
    assert "host: optimizer_state" in out.stdout


def test_the_report_plans_in_the_precision_the_worker_computes_in():
    """``--precision fp16`` halves every activation and workspace byte, as the worker's IPU
    plans them; the report used to plan fp16 runs in float32."""
    rows = {}
    for precision in ("fp32", "fp16"):
        out = _report("--precision", precision, "--data-dir", "/nonexistent")
        assert out.returncode == 0, out.stderr
        assert f"(state on the host), {precision}" in out.stdout
        table = (line.split() for line in out.stdout.splitlines() if line.strip())
        rows[precision] = {
            r[0]: int(r[1].replace(",", "")) for r in table if r[1:2] and r[1][0].isdigit()
        }
    assert rows["fp16"]["activations"] * 2 == rows["fp32"]["activations"] > 0
