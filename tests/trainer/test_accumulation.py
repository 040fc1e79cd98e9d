"""Gradient accumulation against its definition: K micro-batches of B, summed on the IPU and
reduced once, are one optimizer step of a batch of K·B (the cnn has no batch-coupled layer)."""

from __future__ import annotations

import json

import numpy as np
from support import procs as procs_mod
from support.ports import loopback_addresses
from support.reference import single_worker_run

from ringtrain_trainer.checkpoint.store import CheckpointManager
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.accumulate import ACCUMULATOR_ROW, Accumulator
from ringtrain_trainer.ipu.device import IPU, IPUConfig
from ringtrain_trainer.keras.load import build

STEPS = ["--steps", "4", "--eval-every", "0", "--dataset", "mnist-5k", "--optimizer", "sgd"]


def test_accumulator_streams_the_mean_only_on_the_last_micro_batch():
    acc = Accumulator(3, 4)
    g = np.zeros(4, np.float32)
    for m, v in enumerate((1.0, 2.0, 6.0)):
        g[:] = v
        assert acc.fold(g, 0, 4, m) is (m == 2)
    np.testing.assert_array_equal(g, np.full(4, 3.0, np.float32))


def test_the_memory_report_shows_the_accumulator():
    spec = build("cnn")
    p, g = spec.init(0), np.zeros(spec.num_params, np.float32)
    one = IPU(spec, IPUConfig(), p, g).plan(32, True)
    four = IPU(spec, IPUConfig(accumulation=4), p, g).plan(32, True)
    assert four.gradients - one.gradients == spec.num_params * 4
    assert four.by_layer[-1].name == ACCUMULATOR_ROW
    assert IPU(spec, IPUConfig(accumulation=4), p, g).plan(32, False) == IPU(
        spec, IPUConfig(), p, g
    ).plan(32, False)


def test_k_micro_batches_equal_one_batch_of_k_b(mnist5k):
    big = single_worker_run(TrainerConfig.from_args([*STEPS, "--batch-size", "64"], {}), mnist5k)
    acc = single_worker_run(
        TrainerConfig.from_args(
            [*STEPS, "--batch-size", "16", "--gradient-accumulation-steps", "4"], {}
        ),
        mnist5k,
    )
    assert acc.sharder.global_batch == big.sharder.global_batch == 64
    assert acc.ipu.stats.steps == 4 * big.ipu.stats.steps
    assert not np.array_equal(acc.params, big.spec.init(0))
    np.testing.assert_allclose(acc.params, big.params, rtol=1e-4, atol=1e-6)


#: Flatten-Dense-Dropout-Dense as model.to_json() text: Dropout's masks are per example
DROPOUT = json.dumps(
    {
        "class_name": "Sequential",
        "config": {
            "name": "dropout",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_shape": [None, 28, 28]}},
                {"class_name": "Flatten", "config": {}},
                {"class_name": "Dense", "config": {"units": 32, "activation": "relu"}},
                {"class_name": "Dropout", "config": {"rate": 0.5}},
                {"class_name": "Dense", "config": {"units": 10}},
            ],
        },
    }
)


def test_with_dropout_too_each_micro_batch_gets_the_big_batchs_masks(mnist5k):
    model = ["--model", DROPOUT]
    big = single_worker_run(
        TrainerConfig.from_args([*STEPS, *model, "--batch-size", "32"], {}), mnist5k
    )
    argv = [*STEPS, *model, "--batch-size", "8", "--gradient-accumulation-steps", "4"]
    acc = single_worker_run(TrainerConfig.from_args(argv, {}), mnist5k)
    np.testing.assert_allclose(acc.params, big.params, rtol=1e-4, atol=1e-6)


def _params_of(tmp_path, argv: list[str], n: int) -> tuple[list[dict], np.ndarray]:
    addresses, token = loopback_addresses(n), procs_mod.new_token()
    ckpt = tmp_path / "ckpt"
    base = [*procs_mod.WORKER, *STEPS, "--json", "--checkpoint-dir", str(ckpt), *argv]
    procs = [procs_mod.start_member(base, addresses, r, token) for r in range(n)]
    finals = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        finals.append(json.loads(out.strip().splitlines()[-1]))
    return finals, CheckpointManager(ckpt).load(finals[0]["checkpoint"]).params


def test_two_workers_accumulating_equal_one_worker_with_the_global_batch(tmp_path, mnist5k):
    finals, params = _params_of(
        tmp_path, ["--batch-size", "8", "--gradient-accumulation-steps", "4"], 2
    )
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    ref = single_worker_run(TrainerConfig.from_args([*STEPS, "--batch-size", "64"], {}), mnist5k)
    np.testing.assert_allclose(params, ref.params, rtol=1e-4, atol=1e-6)
