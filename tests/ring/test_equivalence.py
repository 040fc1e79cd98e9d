"""N synchronous workers with per-worker batch B train exactly like one worker with batch N·B.

The test that proves the whole pipeline: data sharding, loss scaling, gradient streaming,
bucketing, the ring's mean allreduce over real processes and TCP on loopback, the initial
broadcast and the host-side optimizer. A global batch of 12 lets N = 2, 3 and 4 share one
single-worker reference per optimizer (B = 12 / N). The Open MPI backend must train the same.

With Dropout and BatchNormalization (a Keras config) the rule of docs/trainer.md decides what
"the same" is: dropout masks depend on (seed, layer, step, global example), BatchNormalization's
batch statistics are per replica, so N workers × B equal one worker with N replicas of B
(``--ipus-per-worker N``), not one replica with batch N·B.
"""

import json
import subprocess

import numpy as np
import pytest
from support import procs as procs_mod
from support.ports import loopback_addresses

GLOBAL_BATCH = 12
STEPS = 50
LR = {"sgd": 0.01, "adam": 0.001}


def worker_args(out, world: int, optimizer: str, log) -> list[str]:
    return [
        "worker",
        "--dataset",
        "mnist-5k",
        "--steps",
        str(STEPS),
        "--batch-size",
        str(GLOBAL_BATCH // world),
        "--optimizer",
        optimizer,
        "--lr",
        str(LR[optimizer]),
        "--seed",
        "7",
        "--bucket-mb",
        "0.25",
        "--checkpoint-dir",
        str(out),
        "--json",
        "--termination-log",
        str(log),
    ]


def final_weights(stdout: str, world: int) -> np.ndarray:
    """The chief's final line names its checkpoint; read the weights from its .npz."""
    final = json.loads(stdout.strip().splitlines()[-1])
    assert final["event"] == "final" and final["steps"] == STEPS and final["world_size"] == world
    with np.load(final["checkpoint"].removesuffix(".json") + ".npz") as z:
        return z["params"].copy()


def train(tmp_path, name: str, world: int, optimizer: str, extra: tuple = ()) -> np.ndarray:
    """Run ``world`` real worker processes over the TCP ring; the final flat weights."""
    commands = [
        [
            *procs_mod.CLI,
            *worker_args(tmp_path / name, world, optimizer, tmp_path / f"{name}-{i}.json"),
            *extra,
        ]
        for i in range(world)
    ]
    procs = procs_mod.start_members(commands, loopback_addresses(world), "equivalence")
    outputs = procs_mod.finish(procs, timeout_s=240, what=f"{name} worker")
    return final_weights(outputs[0][0], world)


def assert_same(weights: np.ndarray, reference: np.ndarray, what: str) -> None:
    bad = ~np.isclose(weights, reference, rtol=1e-4, atol=1e-6)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} weights differ, max |diff| "
        f"{np.abs(weights - reference).max():.3g}"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One worker with the global batch, per optimizer (computed once, shared)."""
    cache: dict[str, np.ndarray] = {}

    def get(optimizer: str) -> np.ndarray:
        if optimizer not in cache:
            cache[optimizer] = train(tmp_path_factory.mktemp("ref"), "n1", 1, optimizer)
        return cache[optimizer]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_n_workers_match_one_worker_with_the_global_batch(tmp_path, reference, optimizer):
    for world in (2, 3, 4):
        assert_same(
            train(tmp_path, f"n{world}", world, optimizer),
            reference(optimizer),
            f"{optimizer}, {world} workers over the ring",
        )


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_mpirun_workers_match_one_worker_with_the_global_batch(tmp_path, reference):
    cmd = [
        *procs_mod.mpirun(2),
        *procs_mod.CLI,
        *worker_args(tmp_path / "mpi", 2, "adam", tmp_path / "mpi.json"),
        "--collective",
        "mpi",
    ]
    out = subprocess.run(
        cmd, env=procs_mod.without_cluster(), capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # Rank 0's termination log, not stdout: mpirun forwards output in pieces.
    final = (tmp_path / "mpi.json").read_text()
    assert_same(final_weights(final, 2), reference("adam"), "adam, 2 workers under mpirun")


#: Conv2D → BatchNormalization → Dropout → Dense, as model.to_json() writes it (tf.keras 2)
DROPOUT_BN = {
    "class_name": "Sequential",
    "config": {
        "name": "dropout_bn",
        "layers": [
            {"class_name": "InputLayer", "config": {"batch_input_shape": [None, 28, 28]}},
            {"class_name": "Reshape", "config": {"name": "reshape", "target_shape": [28, 28, 1]}},
            {
                "class_name": "Conv2D",
                "config": {
                    "name": "conv2d",
                    "filters": 4,
                    "kernel_size": [3, 3],
                    "strides": [2, 2],
                    "activation": "relu",
                },
            },
            {"class_name": "BatchNormalization", "config": {"name": "bn", "momentum": 0.9}},
            {"class_name": "Flatten", "config": {"name": "flatten"}},
            {"class_name": "Dropout", "config": {"name": "dropout", "rate": 0.3}},
            {"class_name": "Dense", "config": {"name": "out", "units": 10}},
        ],
    },
}


def _rank_order_npz(tmp_path, world: int) -> tuple[str, str]:
    """mnist-5k as two .npz files: as it is, and reordered so that one worker reading its
    (equally shuffled) stream meets, at every step, the global batch in rank order
    (``Sharder.global_batch_indices``): worker 0's B examples, then worker 1's."""
    from ringtrain_trainer.data import dataset as data_mod

    ds = data_mod.load("mnist-5k")
    # as float x/255: a .npz is fed as stored, and this model has no Rescaling
    x, y = ds.train.inputs(), ds.train.labels
    sharder = data_mod.Sharder(len(x), GLOBAL_BATCH // world, world, seed=7)
    xr, yr = x.copy(), y.copy()
    for k in range(STEPS):  # all within epoch 0
        read = sharder.order(0)[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        src = sharder.global_batch_indices(0, k)
        xr[read], yr[read] = x[src], y[src]
    paths = []
    for name, (a, b) in (("plain", (x, y)), ("rank-order", (xr, yr))):
        np.savez(
            tmp_path / f"{name}.npz",
            x_train=a,
            y_train=b,
            x_test=ds.test.inputs(),
            y_test=ds.test.labels,
        )
        paths.append(str(tmp_path / f"{name}.npz"))
    return paths[0], paths[1]


@pytest.mark.timeout(600)
def test_dropout_and_batchnorm_workers_match_one_worker_with_one_replica_per_worker(tmp_path):
    """2 real workers × batch 6 over the ring == 1 worker × 2 replicas × 6 that meets the same
    global batch in rank order (same trainable weights). The plain single worker meets the
    step's examples in another order (tf.data's shard interleaves), so its replicas group them
    differently: different batch statistics and dropout masks; one replica × 12 computes the
    statistics over all 12."""
    plain, rank_order = _rank_order_npz(tmp_path, 2)
    model = ("--model", json.dumps(DROPOUT_BN, separators=(",", ":")), "--dataset", "fashion-mnist")
    two_workers = train(tmp_path, "w2", 2, "adam", (*model, "--data", plain))
    two_replicas = train(
        tmp_path, "r2", 1, "adam", (*model, "--data", rank_order, "--ipus-per-worker", "2")
    )
    assert_same(two_workers, two_replicas, "dropout+batchnorm, 2 workers vs 1 worker x 2 IPUs")
    for name, extra in (
        ("plain-r2", ("--data", plain, "--ipus-per-worker", "2")),
        ("r1", ("--data", rank_order)),
    ):
        other = train(tmp_path, name, 1, "adam", (*model, *extra))
        assert not np.allclose(other, two_replicas, rtol=1e-4, atol=1e-6), name
