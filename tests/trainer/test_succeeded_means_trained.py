""" "Succeeded" means the model trained (issue 35): dynamic loss scaling may skip a step whose
reduced gradient is not finite, as Keras' LossScaleOptimizer does, but only within stated bounds
(``divergence.Skips``), and a model whose state (moving statistics) is not finite is never
saved, exported or reported as a success.

Before these bounds a job whose every batch overflowed float16 skipped every step and, shorter
than 64 steps, ended Succeeded with untrained weights."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
from support.reference import single_worker_run

from ringtrain.errors import Diverged
from ringtrain_trainer import divergence
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.keras import load as keras_model


def _npz(path, ds, poison_fraction: float) -> str:
    x = ds.train.images.astype(np.float32) * np.float32(ds.train.scale)
    bad = np.random.default_rng(0).random(len(x)) < poison_fraction
    x[bad] = 1e5  # beyond float16's 65504: inf on the IPU
    xt = ds.test.images.astype(np.float32) * np.float32(ds.test.scale)
    np.savez(path, x_train=x, y_train=ds.train.labels, x_test=xt, y_test=ds.test.labels)
    return str(path)


def _config(data: str, *extra: str) -> TrainerConfig:
    argv = ["--data", data, "--precision", "fp16", "--batch-size", "16", "--eval-every", "0"]
    return TrainerConfig.from_args([*argv, *extra], {})


def test_a_run_whose_every_step_overflows_fails_naming_its_skipped_steps(tmp_path, mnist5k):
    data = _npz(tmp_path / "all-bad.npz", mnist5k, 1.0)
    with pytest.raises(Diverged) as e:
        single_worker_run(_config(data, "--steps", "30"))
    # 30 steps allow the grace of 8 skipped steps: the 9th fails the job
    assert "step 9 rank 0: training diverged: 9 steps of this run were skipped" in str(e.value)
    assert "loss scale 64" in str(e.value)


def test_a_clean_fp16_run_succeeds_and_counts_its_skipped_steps(tmp_path, mnist5k):
    t = single_worker_run(_config(_npz(tmp_path / "clean.npz", mnist5k, 0.0), "--steps", "20"))
    assert t.step == 20
    assert t.skips.total == t.loss_scale.skipped <= divergence.SKIP_GRACE
    assert np.isfinite(t.params).all()


def test_the_bounds_on_skipped_steps_over_the_run_and_over_a_window():
    run = divergence.Skips(total_steps=1000)  # 5 %: 50 allowed
    assert run.allowed == 50
    for step in range(1, 1001):
        skipped = step % 20 == 0  # one in 20: 50 in all, 5 in any window of 100
        run.record(skipped, 1024.0, f"step {step}")
    assert run.total == 50
    short = divergence.Skips(total_steps=30)  # the grace: 8, whatever the length
    for step in range(1, 9):
        short.record(True, 1024.0, f"step {step}")
    with pytest.raises(Diverged, match=r"step 9: .*9 steps of this run were skipped \(at most 8"):
        short.record(True, 1024.0, "step 9")
    window = divergence.Skips(total_steps=100_000)  # 5000 allowed in all
    for step in range(1, 76):
        window.record(False, 1024.0, f"step {step}")
    for step in range(76, 101):
        window.record(True, 1024.0, f"step {step}")
    with pytest.raises(Diverged, match="26 of the last 100 steps were skipped"):
        window.record(True, 1024.0, "step 101")
    floor = divergence.Skips(total_steps=100_000)
    floor.record(True, 1.0, "step 1")  # halved from 2 to 1: still at the floor
    with pytest.raises(Diverged, match=r"step 2: .*the loss scale fell to 0\.5, below 1"):
        floor.record(True, 0.5, "step 2")


def test_a_non_finite_moving_statistic_is_never_saved_and_names_the_tensor():
    inp = keras.Input((6,))
    h = keras.layers.Dense(4, name="hidden")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    out = keras.layers.Dense(3, activation="softmax", name="out")(h)
    model = keras.Model(inp, out)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    spec: ModelSpec = keras_model.load(model.to_json())
    params = spec.init(0)
    state = spec.init_state()
    divergence.check_params(spec, params, "step 5 rank 0", "checkpoint", state)  # finite: fine
    state[4 + 2] = np.inf  # the moving mean's 4 values come first, then the variance's
    with pytest.raises(
        Diverged, match=r"step 5 rank 0: .*model state bn/moving_variance\[2\] = inf"
    ):
        divergence.check_params(spec, params, "step 5 rank 0", "checkpoint", state)
