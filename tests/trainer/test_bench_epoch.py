import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain_bench import epoch as bench_epoch

ROOT = Path(__file__).resolve().parents[2]


# ~50 s on the shared, loaded 2-core machine, most of it importing TensorFlow twice
@pytest.mark.timeout(300)
def test_bench_epoch_runs_both_sides_and_reports_one_json():
    """The real command: 2 ringtrain workers on the ring, then 2 TensorFlow
    MultiWorkerMirroredStrategy workers, 20 steps of mnist-5k each. Both start from the same
    weights and train on the same examples, so their test accuracies must agree closely; the
    ratio must be the two samples/s figures' ratio."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'trainer'}:{ROOT / 'operator'}")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "ringtrain.cli", "bench", "epoch"]
    cmd += ["--dataset", "mnist-5k", "--steps", "20", "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["bench"], r["workers"], r["global_batch"], r["steps"]) == ("epoch", 2, 128, 20)
    assert r["order"].startswith("sequential")
    for side in ("ringtrain", "tensorflow"):
        s = r[side]
        assert s["steps"] == 20
        assert isinstance(s["test_accuracy"], float) and 0 <= s["test_accuracy"] <= 1
        assert s["samples_per_s"] > 0 and 0 < s["epoch_s"] < s["process_s"]
    assert r["tensorflow"]["strategy"] in (
        "MultiWorkerMirroredStrategy",
        "CollectiveAllReduceStrategy",
    )
    assert r["tensorflow"]["intra_op_threads"] == r["threads_per_worker"]
    assert r["ratio"] == pytest.approx(
        r["ringtrain"]["samples_per_s"] / r["tensorflow"]["samples_per_s"], abs=1e-3
    )
    assert r["same_start"] is True
    assert r["ringtrain"]["first_loss"] == pytest.approx(r["tensorflow"]["first_loss"], abs=1e-4)
    # same start, same examples, same update (global mean, Adam): the losses stay close
    assert r["ringtrain"]["final_loss"] == pytest.approx(r["tensorflow"]["final_loss"], rel=0.05)
    assert abs(r["accuracy_gap"]) <= 0.03
    for k in ("load_before", "load_between", "load_after"):
        assert len(r[k]) == 3 and min(r[k]) >= 0
    assert set(r["definitions"]) >= {"samples_per_s", "epoch_s", "ratio"}


def test_bench_epoch_refuses_a_one_step_epoch_before_anything_runs(capsys):
    """TensorFlow's samples/s leaves the first (tracing) step out: one step leaves nothing."""
    assert bench_epoch.main(["--steps", "1"]) == 2
    assert "--steps 0 or >= 2" in capsys.readouterr().err
