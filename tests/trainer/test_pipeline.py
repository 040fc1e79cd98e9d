"""Pipelining across a worker's emulated IPUs (issue 23 item 3): stages cut at single-tensor
places, each on its own IPU with its own memory plan; micro-batches through the stages on
threads; the summed micro-batch gradients equal the unpipelined step's."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict

import numpy as np
import pytest
from pipe_models import conv_stack, residual, text
from support.procs import WORKER

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer import report as memory_report
from ringtrain_trainer import trace
from ringtrain_trainer.engine import cuts, pipeline
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.ipu.pipeline import PipelinedIPU
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.reducer import StepCommStats

_NO_COMM = StepCommStats()


def _train(spec, ipu_factory, steps=3, batch=16, lr=0.05, micro=16):
    params = spec.init(7)
    grads = np.zeros_like(params)
    ipu = ipu_factory(params, grads)
    exe = ipu.compile(micro)
    rng = np.random.default_rng(1)
    losses = []
    for step in range(steps):
        x = rng.random((batch, 28, 28, 1), np.float32)
        y = rng.integers(0, 10, batch)
        losses.append(ipu.train_batch(exe, x, y, step=step))
        params -= lr * grads
    ipu.close()
    return params, losses, ipu


@pytest.mark.parametrize("schedule", ["Grouped", "Sequential"])
@pytest.mark.parametrize(
    "model,stages,n",
    [
        (conv_stack(3, 4, dropout=True), "auto", 2),
        (conv_stack(3, 4), "conv2,pool", 3),
        (residual(), "d3", 2),
    ],
)
def test_pipelined_equals_unpipelined(model, stages, n, schedule):
    spec = keras_model.from_config(model, "m")
    cfg = IPUConfig(host_threads=1, seed=3)
    a, la, _ = _train(spec, lambda p, g: IPU(spec, cfg, p, g))
    b, lb, ipu = _train(
        spec,
        lambda p, g: PipelinedIPU(
            spec,
            IPUConfig(host_threads=1, seed=3, replicas=n, accumulation=4),
            p,
            g,
            stages=stages,
            schedule=schedule,
        ),
        micro=4,  # 4 micro-batches of 4: the plain IPU's batch of 16
    )
    assert len(ipu.stages) == n
    assert ipu.stats.link_bytes > 0
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert not np.array_equal(a, spec.init(7))  # it trained


def test_a_pipeline_takes_the_k_micro_batches_accumulation_takes():
    """The unified option: K = gradient accumulation steps = the pipeline's depth, B = the
    micro-batch; the same K*B examples per step (Dropout's masks included) either way."""
    spec = keras_model.from_config(conv_stack(3, 4, dropout=True), "m")
    cfg = IPUConfig(host_threads=1, seed=3, accumulation=4)
    a, la, _ = _train(spec, lambda p, g: IPU(spec, cfg, p, g), micro=4)
    piped = IPUConfig(host_threads=1, seed=3, accumulation=4, replicas=2)
    b, lb, ipu = _train(spec, lambda p, g: PipelinedIPU(spec, piped, p, g), micro=4)
    assert ipu.compile(4).batch == 16  # a training step: K*B examples
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_cuts_of_a_residual_model_are_only_between_blocks():
    spec = keras_model.from_config(residual(), "r")
    names = [spec.layers[i].name for i in spec.graph.order]
    ks = cuts.single_tensor_cuts(spec.graph)
    begins = sorted(names[k] for k in ks)
    # before the add both d1's and d2's outputs cross: no cut there; before d2 only d1's
    # output does (read by d2 and the add, both after the cut)
    assert begins == ["d2", "d3", "out"]
    with pytest.raises(InvalidSpec, match="'add'"):
        pipeline.split(spec, IPU(spec, IPUConfig(), *_bufs(spec)).plan(4, True), 2, 2, ("add",))


def _bufs(spec):
    p = spec.init(0)
    return p, np.zeros_like(p)


def test_auto_split_balances_the_stages_and_each_stage_has_its_own_plan():
    spec = keras_model.from_config(conv_stack(4, 16), "m")
    ipu = PipelinedIPU(spec, IPUConfig(replicas=2, accumulation=4), *_bufs(spec), stages="auto")
    exe = ipu.compile(16)
    plans = exe.stage_plans
    assert len(plans) == 2 and all(p.total <= p.capacity for p in plans)
    single = IPU(spec, IPUConfig(), *_bufs(spec)).plan(64, True)
    assert max(p.total for p in plans) < single.total
    # every layer is on exactly one stage; the kinds of a stage add up to its total
    seen = [i for st in ipu.stages for i in st.nodes]
    assert sorted(seen) == list(range(len(spec.layers)))
    for p in plans:
        assert sum(r.total for r in p.by_layer) == p.total
    assert any(r.name == pipeline.LINK_IN_ROW for r in plans[1].by_layer)
    ipu.close()


def test_a_model_that_fits_no_split_is_refused_naming_the_largest_stage():
    spec = keras_model.from_config(conv_stack(4, 16), "m")
    ipu = PipelinedIPU(
        spec,
        IPUConfig(replicas=2, memory_bytes=20 * MB, accumulation=2),
        *_bufs(spec),
        stages="auto",
    )
    with pytest.raises(
        IPUCompileError,
        match=r"fits no split into 2 stages: the largest stage, "
        r"stage \d \(layers '\w+'\.\.'\w+'\)",
    ):
        ipu.compile(128)


def test_refusals_before_anything_runs():
    spec = keras_model.from_config(conv_stack(3, 4), "m")
    with pytest.raises(InvalidSpec, match=r"Interleaved.*Grouped and Sequential run"):
        PipelinedIPU(spec, IPUConfig(replicas=2), *_bufs(spec), schedule="Interleaved")
    ipu = PipelinedIPU(spec, IPUConfig(replicas=2), *_bufs(spec), stages="conv2,conv3")
    with pytest.raises(InvalidSpec, match="makes 3 stages, but ipusPerWorker is 2"):
        ipu.compile(8)
    ipu = PipelinedIPU(spec, IPUConfig(replicas=2), *_bufs(spec), stages="nope")
    with pytest.raises(InvalidSpec, match="no layer named 'nope'"):
        ipu.compile(8)
    with pytest.raises(InvalidSpec, match="--pipeline-stages with --precision fp16"):
        PipelinedIPU(spec, IPUConfig(replicas=2, precision="fp16"), *_bufs(spec))
    with pytest.raises(InvalidSpec, match="--pipeline-stages with --stochastic-rounding ON"):
        PipelinedIPU(spec, IPUConfig(replicas=2, stochastic_rounding="ON"), *_bufs(spec))


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--precision", "fp16"], "--precision fp16"),
        (["--loss-scaling", "static"], "--loss-scaling static"),
    ],
)
def test_a_worker_refuses_pipelining_with_numerics_it_does_not_implement(tmp_path, flags, named):
    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(3, 4)))
    out = subprocess.run(
        [
            *WORKER,
            *("--model", str(model), "--dataset", "mnist-5k", "--batch-size", "4"),
            *("--ipus-per-worker", "2", "--pipeline-stages", "auto", "--steps", "1", *flags),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0
    assert f"--pipeline-stages with {named}" in out.stderr, out.stderr[-2000:]
    assert "global batch" not in out.stderr  # refused before the data and the first step


def _intervals(doc):
    lanes = defaultdict(list)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and trace.STAGE <= e["tid"] < trace.STAGE + trace.MAX_STAGES:
            lanes[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return lanes


def test_a_pipelined_worker_trains_and_its_trace_shows_the_stages_overlapping(tmp_path):
    """A real `ringtrain worker` process: refused on one IPU of this size, it trains on two
    pipelined; its trace has a lane per stage whose slices overlap in time."""
    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(4, 8)))
    common = [
        *WORKER,
        "--model",
        str(model),
        "--dataset",
        "mnist-5k",
        "--batch-size",
        "32",
        "--ipu-memory-mb",
        "48",
        "--json",
    ]
    alone = subprocess.run(
        [*common, "--steps", "1"], capture_output=True, text=True, timeout=120, check=False
    )
    assert alone.returncode != 0 and "does not fit the IPU" in alone.stderr
    out = subprocess.run(
        [
            *common,
            "--steps",
            "3",
            "--ipus-per-worker",
            "2",
            "--pipeline-stages",
            "auto",
            "--batch-size",  # 4 micro-batches of 8: the 32 refused above, through 2 stages
            "8",
            "--gradient-accumulation-steps",
            "4",
            "--trace-steps",
            "2-3",
            "--trace-dir",
            str(tmp_path / "trace"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pipeline (Grouped schedule; Interleaved is not implemented): stage 1" in out.stderr
    assert (
        "global batch 32 = micro-batch 8 x gradient accumulation 4 (the pipeline's depth) "
        "x replicas 1 x workers 1"
    ) in out.stderr
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["steps"] == 3
    doc = json.loads((tmp_path / "trace" / "trace.json").read_text())
    lanes = _intervals(doc)
    assert sorted(lanes) == [trace.STAGE, trace.STAGE + 1]
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"pipeline stage 1 (IPU 0)", "pipeline stage 2 (IPU 1)"} <= names
    overlaps = [
        (a, b)
        for a in lanes[trace.STAGE]
        for b in lanes[trace.STAGE + 1]
        if a[0] < b[1] and b[0] < a[1]
    ]
    assert overlaps, "no slice of stage 1 overlaps one of stage 2"


def test_the_operator_budgets_a_pipelined_model_over_all_its_ipus():
    """The operator's arithmetic check refuses a model whose weights do not fit one IPU, but
    a pipeline spreads them over ipusPerWorker IPUs: it must not refuse what would train."""
    from ringtrain_operator import spec as jobspec

    model = {
        "class_name": "Sequential",
        "config": {
            "name": "wide",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_input_shape": [None, 28, 28]}},
                {"class_name": "Flatten", "config": {"name": "flatten"}},
                {"class_name": "Dense", "config": {"name": "d1", "units": 512}},
                {"class_name": "Dense", "config": {"name": "d2", "units": 10}},
            ],
        },
    }
    trainer = {"batchSize": 8, "ipusPerWorker": 4, "ipuMemoryMB": 1, "model": model}
    assert "ipuMemoryMB" in (jobspec.model_error(model, jobspec._budget(trainer)) or "")
    piped = {**trainer, "gradientAccumulationSteps": 2, "pipeline": {"stages": "auto"}}
    assert jobspec._budget(piped) == (4 << 20, 8)  # micro-batches of batchSize
    assert jobspec.model_error(model, jobspec._budget(piped)) is None


def test_report_status_and_metrics_show_each_stage_on_its_ipu(tmp_path):
    import io

    from prometheus_client import CollectorRegistry

    from ringtrain import events
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.telemetry.metrics import TrainerMetrics

    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(4, 8)))
    args = ["--model", str(model), "--batch-size", "8", "--ipus-per-worker", "2"]
    args += ["--pipeline-stages", "conv3", "--gradient-accumulation-steps", "4"]
    args += ["--ipu-memory-mb", "48"]
    out = io.StringIO()
    memory_report.report(TrainerConfig.from_args(args, env={}), out)
    report = out.getvalue()
    assert (
        "micro-batch 8 x gradient accumulation 4 (depth); stage 1 (layers 'conv1'..'conv2') "
        "on IPU 0"
    ) in report
    assert "stage 2 (layers 'conv3'..'dense') on IPU 1" in report
    assert pipeline.LINK_IN_ROW in report

    spec = keras_model.from_config(conv_stack(4, 8), "m")
    ipu = PipelinedIPU(spec, IPUConfig(replicas=2, accumulation=4), *_bufs(spec), stages="conv3")
    exe = ipu.compile(8)
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    metrics.set_plan(exe.plan, 0, stages=exe.stage_plans)
    for s, p in enumerate(exe.stage_plans):
        for kind, n in p.kinds().items():
            labels = {"ipu": str(s), "stage": str(s + 1), "kind": kind}
            assert registry.get_sample_value("ringtrain_ipu_stage_memory_bytes", labels) == n
    doc = metrics.status()["ipu_memory"]
    assert [(d["ipu"], d["stage"], d["total"]) for d in doc["stages"]] == [
        (0, 1, exe.stage_plans[0].total),
        (1, 2, exe.stage_plans[1].total),
    ]
    assert events.Status.from_dict(metrics.status()).ipu_memory == doc
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 28, 28, 1), np.float32), rng.integers(0, 10, 32)
    for step in range(2):
        ipu.train_step(exe, x, y, step=step)
        metrics.observe_step(step + 1, 0, 0.1, 1.0, 10.0, ipu.stats, _NO_COMM)
    busy = [
        registry.get_sample_value(
            "ringtrain_ipu_stage_busy_seconds_total", {"ipu": str(s), "stage": str(s + 1)}
        )
        for s in range(2)
    ]
    assert all(b > 0 for b in busy) and busy == pytest.approx(list(ipu.stats.stage_busy_s))
    assert registry.get_sample_value("ringtrain_ipu_link_bytes_total") == ipu.stats.link_bytes > 0
    ipu.close()


def test_pipelined_and_unpipelined_workers_end_with_the_same_weights(tmp_path):
    """Real `ringtrain worker` processes, same seed and data: the pipelined one (2 IPUs, 4
    micro-batches, Grouped) and the plain one write allclose final checkpoints."""
    from ringtrain_trainer.checkpoint.store import CheckpointManager

    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(3, 4, dropout=True)))
    base = [*WORKER, "--model", str(model), "--dataset", "mnist-5k", "--batch-size", "16"]
    base += ["--steps", "4", "--optimizer", "momentum", "--json"]
    runs = {
        "plain": [],
        "piped": [
            *("--ipus-per-worker", "2", "--pipeline-stages", "auto"),
            *("--batch-size", "4", "--gradient-accumulation-steps", "4"),
        ],
    }
    params = {}
    for name, extra in runs.items():
        ckpt = tmp_path / name
        out = subprocess.run(
            [*base, *extra, "--checkpoint-dir", str(ckpt)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        state, _ = CheckpointManager(ckpt).load_latest()
        assert state is not None and state.step == 4
        params[name] = state.params
    np.testing.assert_allclose(params["piped"], params["plain"], rtol=1e-4, atol=1e-6)
