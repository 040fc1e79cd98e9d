"""Issue 20, item 5: diverged training fails the job instead of reporting Succeeded.

Real ``ringtrain worker`` processes: one +inf pixel in a float ``.npz`` (the step that reads it
is the first non-finite one), and ``--lr 1e308`` (inf as float32) in a ring of two. Before the
fix both exited 0 with a NaN loss, wrote NaN checkpoints over the good ones and exported a NaN
model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from test_trainer_worker_ring import start_gang

from ringtrain.errors import EXIT_DIVERGED
from ringtrain_trainer.checkpoint.store import CheckpointManager
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.keras.load import build
from ringtrain_trainer.reducer.hook import OptimizerHook

WORKER = [sys.executable, "-m", "ringtrain.cli", "worker", "--json"]
N, BATCH, SEED = 128, 16, 1


def npz_with_one_inf_pixel(path, at_step: int) -> None:
    """A float data set whose only +inf pixel is in the batch of step ``at_step`` (1-based)."""
    rng = np.random.default_rng(0)
    x = rng.random((N, 28, 28), np.float32)
    y = rng.integers(0, 10, N).astype(np.uint8)
    first = data_mod.Sharder(N, BATCH, seed=SEED).indices(0, at_step - 1)[0]
    x[first, 3, 4] = np.inf
    np.savez(path, x_train=x, y_train=y, x_test=x[:32].clip(0, 1), y_test=y[:32])


def test_an_inf_pixel_fails_the_job_at_its_step_and_keeps_the_good_checkpoints(tmp_path):
    data, ckpt = tmp_path / "data.npz", tmp_path / "ckpt"
    npz_with_one_inf_pixel(data, at_step=3)
    log = tmp_path / "termination-log"
    out = subprocess.run(
        [
            *WORKER,
            *("--data", str(data), "--batch-size", str(BATCH), "--seed", str(SEED)),
            *("--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"),
            *("--export", "model.keras", "--termination-log", str(log)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_DIVERGED, out.stderr
    assert "step 3 rank 0: training diverged: the reduced gradient of " in out.stderr
    assert "is not finite" in out.stderr and "/bias[" in out.stderr  # last layer first
    error = json.loads(log.read_text())
    assert error["exit_code"] == EXIT_DIVERGED and "step 3" in error["error"]
    state, skipped = CheckpointManager(ckpt).load_latest()
    assert not skipped and state.step == 2  # the good ones are kept, nothing after them
    assert np.isfinite(state.params).all()
    assert not list(tmp_path.rglob("model.keras"))  # no NaN model exported
    progress = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert all(e.get("event") != "final" for e in progress)


def test_an_overflowing_learning_rate_fails_every_worker_of_a_ring_at_the_same_step(tmp_path):
    """--lr 1e308 is inf as float32: the first update makes the parameters non-finite; the
    next step's reduced gradient is NaN on both workers, which both see: each fails itself at
    that step (exit 3), neither waits for the other to time out."""
    procs = start_gang(
        2,
        ["--lr", "1e308", "--steps", "5", "--batch-size", "16", "--ring-step-timeout-s", "60"],
        tmp_path,
    )
    outs = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_DIVERGED, EXIT_DIVERGED], [err[-2000:] for _, err in outs]
    for r, (_, err) in enumerate(outs):
        assert f"step 2 rank {r}: training diverged: the reduced gradient of " in err


def test_a_non_finite_reduced_slice_and_everything_after_it_is_not_applied():
    """The hook checks each slice before the optimizer sees it: a clean slice is applied, a NaN
    one and the rest of the step are not; the next step starts clean."""
    from ringtrain_trainer import optim

    spec = build("cnn")
    params = spec.init(0)
    before = params.copy()
    grads = np.ones_like(params)
    opt = optim.build("sgd", params, optim.StepDecay(0.5, 1.0, 1))
    hook = OptimizerHook(opt, grads)
    hook.begin_step(0)
    half = params.size // 2
    grads[half + 3] = np.nan
    hook(0, half)
    hook(half, params.size)
    assert hook.nonfinite == (half, params.size)
    assert np.array_equal(params[half:], before[half:])  # not applied
    assert not np.array_equal(params[:half], before[:half])  # applied before the NaN
    hook.begin_step(0)
    assert hook.nonfinite is None


def test_finite_is_exact_even_where_a_float32_sum_overflows():
    from ringtrain_trainer.engine.native import finite

    assert finite(np.full(4, 3e38, np.float32))  # the float32 sum is inf; every value finite
    assert finite(np.zeros(0, np.float32))
    for bad in (np.inf, -np.inf, np.nan):
        a = np.ones(100_000, np.float32)
        a[77_777] = bad
        assert not finite(a)
    a = np.ones(10, np.float32)
    a[[2, 5]] = np.inf, -np.inf  # inf - inf is nan: still not finite
    assert not finite(a)
