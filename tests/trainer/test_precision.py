"""Mixed precision on the emulated IPU against its definitions: float16 values (rounded to
nearest or stochastically, unbiased in expectation), replica-identical stochastic rounding
keeping replicas bit-identical, and a memory plan that halves."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.precision import Rounder
from ringtrain_trainer.ipu.device import IPU, IPUConfig
from ringtrain_trainer.keras.load import build


def test_nearest_rounding_is_numpys_float16_cast(rng):
    x = (rng.standard_normal(10_000) * np.float32(100)).astype(np.float32)
    x[:3] = (70000.0, -1e6, 65504.0)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    Rounder(x.size)(x)
    np.testing.assert_array_equal(x, want)
    assert np.isinf(x[:2]).all() and x[2] == 65504.0


def test_stochastic_rounding_is_unbiased_in_expectation():
    n = 200_000
    lo = np.float32(1.0)
    ulp = np.float32(2.0**-10)  # float16's spacing in [1, 2)
    for p in (0.1, 0.37, 0.5, 0.9):
        value = np.float32(lo + p * ulp)
        p = float((value - lo) / ulp)  # the exact fraction of the float32 value
        x = np.full(n, value, np.float32)
        Rounder(n, seed=(7, int(p * 100)))(x)
        assert set(np.unique(x)) <= {lo, np.float32(lo + ulp)}
        # each sample is lo + ulp * Bernoulli(p): the mean's standard deviation is
        # ulp * sqrt(p (1 - p) / n); five of them is a one-in-a-million false alarm
        tol = 5 * float(ulp) * np.sqrt(p * (1 - p) / n)
        assert abs(float(x.astype(np.float64).mean()) - float(value)) < tol
        # to nearest is biased by min(p, 1 - p) ulps, far outside that tolerance
        nearest = np.full(n, value, np.float32)
        Rounder(n)(nearest)
        assert abs(float(nearest.mean()) - float(value)) > 10 * tol


def _ipu(mode: str, rank: int, params: np.ndarray) -> IPU:
    spec = build("cnn")
    cfg = IPUConfig(precision="fp16", stochastic_rounding=mode, rank=rank, seed=3)
    return IPU(spec, cfg, params.copy(), np.zeros_like(params))


def test_replica_identical_only_keeps_replicas_bit_identical():
    params = build("cnn").init(0)
    for _ in range(2):  # the generators advance alike, step after step
        a, b = _ipu("REPLICA_IDENTICAL_ONLY", 0, params), _ipu("REPLICA_IDENTICAL_ONLY", 1, params)
        for ipu in (a, b):
            ipu._stream_weights()
            ipu._stream_weights()
        np.testing.assert_array_equal(a.weights, b.weights)
    nearest = params.astype(np.float16).astype(np.float32)
    assert not np.array_equal(a.weights, nearest)  # stochastic, not to nearest
    on0, on1 = _ipu("ON", 0, params), _ipu("ON", 1, params)
    on0._stream_weights()
    on1._stream_weights()
    assert not np.array_equal(on0.weights, on1.weights)  # what REPLICA_IDENTICAL_ONLY prevents


def test_fp16_halves_the_memory_plan_and_needs_variables_on_host():
    spec = build("cnn")
    p, g = spec.init(0), np.zeros(spec.num_params, np.float32)
    full = IPU(spec, IPUConfig(), p, g).plan(32, True)
    half = IPU(spec, IPUConfig(precision="fp16"), p, g).plan(32, True)
    for kind in ("weights", "gradients", "activations"):
        assert getattr(half, kind) * 2 == getattr(full, kind), kind
    with pytest.raises(InvalidSpec, match="variables on the host"):
        IPU(spec, IPUConfig(precision="fp16", variables_on_host=False), p, g)


def test_an_fp16_step_computes_on_float16_values(mnist5k):
    spec = build("cnn")
    params = spec.init(0)
    grads = np.zeros_like(params)
    ipu = IPU(spec, IPUConfig(precision="fp16"), params, grads)
    exe = ipu.compile(16)
    x = (mnist5k.train.images[:16] * np.float32(mnist5k.train.scale)).astype(np.float32)
    ipu.train_step(exe, x, mnist5k.train.labels[:16])
    for arr in (ipu.weights, grads, exe.programs[0].output):
        np.testing.assert_array_equal(arr, arr.astype(np.float16).astype(np.float32))
    ref_grads = np.zeros_like(params)
    ref = IPU(spec, IPUConfig(), params, ref_grads)
    ref.train_step(ref.compile(16), x, mnist5k.train.labels[:16])
    assert not np.array_equal(grads, ref_grads)
    np.testing.assert_allclose(grads, ref_grads, rtol=5e-2, atol=3e-3)


def test_status_metrics_and_tensorboard_say_what_runs(mnist5k, tmp_path):
    from support.reference import single_worker_run

    from ringtrain_trainer.config import TrainerConfig

    argv = ["--steps", "2", "--eval-every", "0", "--precision", "fp16", "--batch-size", "8"]
    argv += ["--gradient-accumulation-steps", "2", "--ipus-per-worker", "2"]
    argv += ["--tensorboard-dir", str(tmp_path / "tb")]
    t = single_worker_run(TrainerConfig.from_args(argv, {}), mnist5k)
    status = t.metrics.status()
    assert status["accumulation"] == 2
    assert status["numerics"]["precision"] == "fp16"
    assert status["numerics"]["loss_scale"]["scale"] == 32768.0
    reg = t.metrics.registry
    for ipu in ("0", "1"):
        labels = {"ipu": ipu}
        info = {**labels, "precision": "fp16", "stochastic_rounding": "OFF"}
        assert reg.get_sample_value("ringtrain_ipu_precision_info", info) == 1
        assert reg.get_sample_value("ringtrain_ipu_gradient_accumulation_steps", labels) == 2
        assert reg.get_sample_value("ringtrain_ipu_loss_scale", labels) == 32768.0
    assert t.batch_line() == (
        "global batch 16 = micro-batch 4 x gradient accumulation 2 x replicas 2 x workers 1"
    )
    assert t._numerics_scalars()["numerics/loss_scale"] == 32768.0
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))
