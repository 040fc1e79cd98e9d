"""Recomputation (issue 23 item 4): checkpoints kept through forward, the rest of each segment
recomputed in backward; the same weights as without it, a smaller plan, and the option named
in the refusal of a model that fits only with it."""

from __future__ import annotations

import io
import json
import subprocess

import numpy as np
import pytest
from pipe_models import conv_stack, residual, sgd_on_ipu, text
from support.procs import WORKER

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer import report
from ringtrain_trainer.checkpoint.store import CheckpointManager
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import recompute
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.keras import load as keras_model


def _train(spec, cfg, steps=3, batch=16, lr=0.05):
    return sgd_on_ipu(spec, cfg, steps, batch, lr)


@pytest.mark.parametrize(
    "model,checkpoints",
    [
        (conv_stack(4, 4, dropout=True), ()),
        (conv_stack(4, 4), ("conv2",)),
        (residual(), ("d1",)),
    ],
)
def test_recompute_gives_the_same_weights_and_really_recomputes(model, checkpoints):
    spec = keras_model.from_config(model, "m")
    a, la, _, _ = _train(spec, IPUConfig(host_threads=1, seed=1))
    cfg = IPUConfig(host_threads=1, seed=1, recompute=True, recompute_checkpoints=checkpoints)
    b, lb, exe, _ = _train(spec, cfg)
    prog = exe.programs[0]
    assert isinstance(prog, recompute.RecomputeProgram) and len(prog.segments) > 1
    assert prog.recomputed > 0  # forwards run again in backward
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert exe.baseline is not None and exe.plan.total < exe.baseline.total
    assert sum(r.total for r in exe.plan.by_layer) == exe.plan.total
    assert recompute.CHECKPOINT_ROW in [r.name for r in exe.plan.by_layer]


#: an IPU the deep conv model fits only with recomputation (≈ 51 MB with, ≈ 120 MB without)
CAP_MB = 56


def test_a_model_that_fits_only_with_recompute_is_refused_naming_the_option():
    spec = keras_model.from_config(conv_stack(4, 16), "m")
    p = spec.init(0)
    with pytest.raises(
        IPUCompileError,
        match=r"it fits with recomputation: [\d,]+ bytes "
        r"\(--allow-recompute, spec.trainer.allowRecompute: true\)",
    ):
        IPU(spec, IPUConfig(memory_bytes=CAP_MB * MB), p, np.zeros_like(p)).compile(32)
    exe = IPU(
        spec, IPUConfig(memory_bytes=CAP_MB * MB, recompute=True), p, np.zeros_like(p)
    ).compile(32)
    assert exe.plan.total <= CAP_MB * MB < exe.baseline.total


def test_a_named_checkpoint_must_be_a_place_one_tensor_crosses():
    spec = keras_model.from_config(residual(), "r")
    p = spec.init(0)
    for name, why in [("nope", "no layer named 'nope'"), ("d2", "'d2': its output is not")]:
        cfg = IPUConfig(recompute=True, recompute_checkpoints=(name,))
        with pytest.raises(InvalidSpec, match=why):
            IPU(spec, cfg, p, np.zeros_like(p)).compile(8)


def test_the_memory_report_shows_the_peak_with_and_without(tmp_path):
    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(4, 16)))
    args = ["--model", str(model), "--batch-size", "32", "--ipu-memory-mb", str(CAP_MB)]
    out = io.StringIO()
    report.report(TrainerConfig.from_args([*args, "--allow-recompute"], env={}), out)
    text_ = out.getvalue()
    assert "with recomputation" in text_ and recompute.CHECKPOINT_ROW in text_
    line = next(x for x in text_.splitlines() if x.startswith("recomputation: peak"))
    # "recomputation: peak N bytes with it, M without"
    with_, without = (int(line.split()[k].replace(",", "")) for k in (2, 6))
    assert with_ <= CAP_MB * MB < without


def test_a_worker_refused_today_trains_with_recompute(tmp_path):
    """A real `ringtrain worker`: refused for memory without the option, trains with it."""
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
        "32",
        "--steps",
        "3",
        "--json",
    ]
    refused = subprocess.run(common, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0
    assert "--allow-recompute" in refused.stderr
    ok = subprocess.run(
        [*common, "--allow-recompute"], capture_output=True, text=True, timeout=120, check=False
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "recomputation: peak" in ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["steps"] == 3


@pytest.mark.slow  # two worker processes: ~30 s on 2 busy cores
def test_a_recomputing_worker_ends_with_the_weights_of_a_plain_one(tmp_path):
    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(4, 8)))
    common = [*WORKER, "--model", str(model), "--dataset", "mnist-5k", "--batch-size", "32"]
    common += ["--steps", "3", "--json"]
    rc = [*common, "--ipu-memory-mb", "32", "--allow-recompute"]
    ok = subprocess.run(
        [*rc, "--checkpoint-dir", str(tmp_path / "rc")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    big = [*common, "--ipu-memory-mb", "900", "--checkpoint-dir", str(tmp_path / "plain")]
    plain = subprocess.run(big, capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, _ = CheckpointManager(tmp_path / "rc").load_latest()
    b, _ = CheckpointManager(tmp_path / "plain").load_latest()
    assert a is not None and b is not None and a.step == b.step == 3
    np.testing.assert_allclose(a.params, b.params, rtol=1e-5, atol=1e-7)


def test_status_shows_both_peaks():
    from prometheus_client import CollectorRegistry

    from ringtrain_trainer.telemetry.metrics import TrainerMetrics

    spec = keras_model.from_config(conv_stack(4, 4), "m")
    p = spec.init(0)
    exe = IPU(spec, IPUConfig(recompute=True), p, np.zeros_like(p)).compile(16)
    metrics = TrainerMetrics(CollectorRegistry())
    metrics.set_plan(exe.plan, 0, baseline=exe.baseline)
    doc = metrics.status()["ipu_memory"]
    assert doc["recompute"] == {"total": exe.plan.total, "without_recompute": exe.baseline.total}
    assert doc["total"] == exe.plan.total < exe.baseline.total
