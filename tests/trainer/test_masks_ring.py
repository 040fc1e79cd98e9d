"""A masked text classifier (Embedding(mask_zero=True) → LSTM → Dense, a ``.keras`` file Keras
wrote) trained by 2 real worker processes over the gRPC ring with batch 4 ends where 1 worker
with batch 8 ends: every example's mask is its own, both processes build the same graph."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support import procs as procs_mod
from support.ports import loopback_addresses
from support.reference import single_worker_run

from ringtrain_trainer.checkpoint.store import CheckpointManager
from ringtrain_trainer.config import TrainerConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
L = keras.layers
WORKERS, BATCH, STEPS, VOCAB, SEQ = 2, 4, 4, 30, 8


def _argv(model, data, ck, batch):
    return [
        "--model", str(model), "--data", str(data), "--steps", str(STEPS),
        "--batch-size", str(batch), "--seed", "3", "--checkpoint-dir", str(ck),
        "--checkpoint-every", str(STEPS), "--ipu-host-threads", "1",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ring_workers_of_a_masked_model_equal_one_worker_with_twice_the_batch(tmp_path, rng):
    keras.utils.set_random_seed(3)
    km = keras.Sequential(
        [
            L.Input((SEQ,), dtype="int32"),
            L.Embedding(VOCAB, 8, mask_zero=True),
            L.LSTM(6),
            L.Dense(3),
        ]
    )
    km.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    km.save(tmp_path / "m.keras")
    x = rng.integers(1, VOCAB, (48, SEQ)).astype(np.int32)
    for i, k in enumerate(rng.integers(1, SEQ, 48)):
        x[i, k:] = 0  # right padding of every length
    y = (x[:, 0] % 3).astype(np.int64)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    model, data = tmp_path / "m.keras", tmp_path / "d.npz"

    addresses, token = loopback_addresses(WORKERS), procs_mod.new_token()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    argv = _argv(model, data, tmp_path / "ck", BATCH)
    procs = [
        procs_mod.start_member([*procs_mod.WORKER, *argv], addresses, r, token, env)
        for r in range(WORKERS)
    ]
    outs = [p.communicate(timeout=200) for p in procs]
    assert [p.returncode for p in procs] == [0] * WORKERS, [e[-3000:] for _, e in outs]
    ck = CheckpointManager(str(tmp_path / "ck"))
    ring = ck.load(ck.manifests()[-1])
    assert ring.step == STEPS

    one = single_worker_run(
        TrainerConfig.from_args(_argv(model, data, tmp_path / "one", WORKERS * BATCH), {})
    )
    start = TrainerConfig.from_args(_argv(model, data, tmp_path / "zero", BATCH), {})
    assert not np.allclose(one.params, single_worker_run(start).params, atol=1e-4)
    np.testing.assert_allclose(one.params, ring.params, rtol=0, atol=1e-5)
