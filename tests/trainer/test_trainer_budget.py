"""Issue 20, item 1, the worker's side: a real ``ringtrain worker`` refuses a model too large
for its IPU by arithmetic, before it allocates anything proportional to the model (before, it
built the model, 578 MiB for the layout alone, then failed allocating 29 TiB of parameters)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringtrain.errors import EXIT_PERMANENT
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.keras import budget
from ringtrain_trainer.keras import config as K
from ringtrain_trainer.keras import load as KM

HUGE = {
    "class_name": "Sequential",
    "config": {
        "name": "huge",
        "layers": [
            {"class_name": "InputLayer", "config": {"batch_shape": [None, 28, 28, 1]}},
            {"class_name": "Flatten", "config": {}},
            {"class_name": "Dense", "config": {"units": 10**10}},
            {"class_name": "Dense", "config": {"units": 10}},
        ],
    },
}


def test_a_worker_refuses_a_huge_inline_model_by_arithmetic_in_little_memory(tmp_path):
    log = tmp_path / "log"
    argv = [sys.executable, "-m", "ringtrain.cli", "worker", "--dataset", "mnist-5k"]
    argv += ["--model", json.dumps(HUGE), "--termination-log", str(log)]
    # a wrapper reports the worker's own peak RSS (RUSAGE_CHILDREN: that one child)
    wrapper = (
        "import resource, subprocess, sys, json\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(json.dumps({'rc': p.returncode, 'err': p.stderr, 'peak_mib': peak}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, timeout=120
    )
    got = json.loads(out.stdout)
    assert got["rc"] == EXIT_PERMANENT, got["err"][-2000:]
    assert "bytes needed per IPU" in got["err"] and "7,950,000,000,010 parameters" in got["err"]
    assert "ipuMemoryMB" in got["err"]
    assert got["peak_mib"] < 128, got["peak_mib"]
    error = json.loads(log.read_text())
    assert error["exit_code"] == EXIT_PERMANENT and "InvalidSpec" in error["error"]
    print(json.dumps({"case": "worker_huge_model_refused", "peak_mib": got["peak_mib"]}))


@pytest.mark.parametrize("model", ["cnn", "cnn2", "WIDE", "NARROW"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_budget_never_asks_more_than_the_ipu_plan_so_it_never_refuses_what_compiles(
    model, batch
):
    """The arithmetic is a lower bound of ``memory.plan_memory``: what the budget refuses, the
    IPU would refuse at compile time too (it only refuses it earlier and without building)."""
    from test_keras_layers import NARROW, WIDE

    config = {"WIDE": WIDE, "NARROW": NARROW}.get(model) or KM.preset_config(model)
    spec = KM.from_config(config)
    plan = memory.plan_memory(spec, batch, True, 4, 1 << 40, 0)
    need = budget.need_bytes(K.parse(config), batch)
    assert 0 < need <= plan.total
    assert need >= plan.weights + plan.gradients  # the parameters are counted exactly
