"""Sharded ``.npy``/``.npz`` data sets (decision 0209): read in place, the same samples in the
same order whatever the number of workers, resumed at the exact sample, and a worker's memory
bounded whatever the data set's size."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
from support.reference import single_worker_run

from ringtrain.errors import DataError
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.feed import Feed
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.worker import Trainer

#: uneven shard boundaries over 480 training examples (20 global batches of 24)
CUTS = (0, 37, 200, 201, 333, 480)


def write_shards(d, x, y, xt, yt, cuts=CUTS) -> None:
    """``.npz`` and ``.npy`` shards alternating, named so sorted order is the data's order."""
    d.mkdir(parents=True, exist_ok=True)
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        if i % 2:
            np.savez(d / f"part-{i:02d}.npz", x_train=x[a:b], y_train=y[a:b])
        else:
            np.save(d / f"x_train-{i:02d}.npy", x[a:b])
            np.save(d / f"y_train-{i:02d}.npy", y[a:b])
    np.savez(d / "zz-test.npz", x_test=xt, y_test=yt)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """480 + 200 real digits as float32 ``x / 255``: a sharded directory and the same data as
    one ``.npz`` (the in-memory path)."""
    m = data_mod.load_mnist5k()
    rng = np.random.default_rng(7)
    tr, te = rng.permutation(len(m.train))[:480], rng.permutation(len(m.test))[:200]
    x = (m.train.images[tr] / 255).astype(np.float32)
    xt = (m.test.images[te] / 255).astype(np.float32)
    y, yt = m.train.labels[tr], m.test.labels[te]
    tmp = tmp_path_factory.mktemp("shards")
    # npy names sort before npz names: order the arrays as the files sort
    write_shards(tmp / "s", x, y, xt, yt)
    files = sorted(os.listdir(tmp / "s"))
    order = []
    for f in files:
        if f.startswith("x_train-") or (f.startswith("part-") and f.endswith(".npz")):
            i = int(f.split("-")[1][:2])
            order.extend(range(CUTS[i], CUTS[i + 1]))
    np.savez(tmp / "whole.npz", x_train=x[order], y_train=y[order], x_test=xt, y_test=yt)
    return {"dir": str(tmp / "s"), "npz": str(tmp / "whole.npz"), "x": x[order], "y": y[order]}


def cfg(data, **kw) -> TrainerConfig:
    base = {"dataset": "fashion-mnist", "data_dir": data, "optimizer": "sgd", "lr": 0.05}
    return TrainerConfig(**{"seed": 3, "steps": 6, "eval_every": 0, "batch_size": 24, **base, **kw})


def run_world(world: int, config: TrainerConfig) -> list[Trainer]:
    """``world`` trainers on threads over one in-process collective, run to their end."""
    from thread_collective import ThreadGroup

    cols = ThreadGroup(world).collectives()
    trainers = [Trainer(config, c, out=io.StringIO()) for c in cols]
    errors: list[BaseException] = []

    def body(t):
        try:
            t.run()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            t.collective.group.barrier.abort()

    threads = [threading.Thread(target=body, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in trainers:
        t.close()
    if errors:
        raise errors[0]
    return trainers


def test_shards_read_in_place_are_the_concatenated_data(small):
    ds = data_mod.load("fashion-mnist", small["dir"])
    x = ds.train.images
    assert (x.shape, x.dtype, len(x.parts)) == ((480, 28, 28), np.float32, 5)
    assert np.array_equal(ds.train.labels, small["y"])
    idx = np.array([479, 0, 36, 37, 200, 199, 201, 202, 333, 332, 5, 6, 7])
    out = np.empty((len(idx), 28, 28), np.float32)
    x.take_into(idx, out)
    np.testing.assert_array_equal(out, small["x"][idx])
    np.testing.assert_array_equal(x[30:340].reshape(-1, 784), small["x"][30:340].reshape(-1, 784))
    assert len(ds.test) == 200 and ds.num_classes == 10


def test_the_sharded_path_trains_the_same_weights_as_the_in_memory_path(small):
    shards = single_worker_run(cfg(small["dir"], eval_every=3))
    memory = single_worker_run(cfg(small["npz"], eval_every=3))
    assert isinstance(shards.data.train.images, ShardedArray)
    np.testing.assert_array_equal(shards.params, memory.params)
    assert shards.test_accuracy == memory.test_accuracy
    assert shards.feed.background and not memory.feed.background


@pytest.mark.parametrize("world", [2, 3])
def test_n_workers_over_shards_equal_one_worker_with_the_global_batch(small, world):
    single = single_worker_run(cfg(small["dir"]))
    ring = run_world(world, cfg(small["dir"], batch_size=24 // world))
    for t in ring:  # the tolerance of test_trainer_reducer's in-memory N x B == 1 x NB
        np.testing.assert_allclose(t.params, single.params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("first, then", [(1, 1), (2, 3)])
def test_a_run_resumed_mid_epoch_over_shards_equals_an_uninterrupted_one(
    small, tmp_path, first, then
):
    """30 steps of 24 cross the 20-step epoch; the checkpoint at step 13 is mid-epoch. Resumed
    by the same or another number of workers (same global batch), the run ends where an
    uninterrupted one does."""
    straight = single_worker_run(cfg(small["dir"], steps=30))
    ck = str(tmp_path / "ck")
    run_world(first, cfg(small["dir"], steps=13, batch_size=24 // first, checkpoint_dir=ck))
    assert os.path.exists(os.path.join(ck, "ckpt-0000000013.json"))
    resumed = run_world(then, cfg(small["dir"], steps=30, batch_size=24 // then, checkpoint_dir=ck))
    assert resumed[0].position == straight.position == data_mod.Position(1, 10, 24)
    for t in resumed:
        if first == then == 1:
            np.testing.assert_array_equal(t.params, straight.params)
        else:
            np.testing.assert_allclose(t.params, straight.params, rtol=1e-4, atol=1e-6)


def test_prefetch_reads_the_next_batch_into_the_other_buffer(small):
    ds = data_mod.load("fashion-mnist", small["dir"])
    sharder = data_mod.Sharder(len(ds.train), 8, seed=1)
    feed = Feed(ds.train, sharder, (28, 28, 1), lambda: np.zeros(8, np.int64))
    pos, seen = data_mod.Position(0, 0, 8), []
    try:
        for _ in range(sharder.steps_per_epoch + 2):  # across an epoch
            x, y = feed.get(pos)
            idx = sharder.indices(pos.epoch, pos.batch)
            np.testing.assert_array_equal(x.reshape(8, 28, 28), small["x"][idx])
            np.testing.assert_array_equal(y, small["y"][idx])
            seen.append(x.ctypes.data)
            pos = sharder.advance(pos)
        x, _ = feed.get(data_mod.Position(0, 3, 8))  # not the one prefetched: read inline
        np.testing.assert_array_equal(x.reshape(8, 28, 28), small["x"][sharder.indices(0, 3)])
    finally:
        feed.close()
    assert len(set(seen)) == 2  # two preallocated buffers, alternating
    assert feed.total_wait_s > 0


def test_what_the_shards_cannot_be_is_refused_naming_the_file_and_the_array(tmp_path, small):
    x = np.zeros((10, 28, 28), np.float32)
    y = np.zeros(10, np.int64)
    d = tmp_path / "compressed"
    d.mkdir()
    np.savez_compressed(d / "a.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    with pytest.raises(DataError, match=r"a\.npz: x_train is compressed"):
        data_mod.load("fashion-mnist", d)
    d = tmp_path / "mixed"
    d.mkdir()
    np.savez(d / "a.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    np.savez(d / "b.npz", x_train=x[:, :27], y_train=y)
    with pytest.raises(DataError, match=r"b\.npz: x_train is float32 examples of \(27, 28\), but "):
        data_mod.load("fashion-mnist", d)
    d = tmp_path / "lonely"
    d.mkdir()
    np.save(d / "x_train-1.npy", x)
    with pytest.raises(DataError, match=r"x_train-1\.npy: its partner y_train-1\.npy"):
        data_mod.load("fashion-mnist", str(d / "*.npy"))
    d = tmp_path / "wrong-model"
    d.mkdir()
    big = np.zeros((40, 32, 32), np.float32)
    labels = np.zeros(40, np.int64)
    np.savez(d / "a.npz", x_train=big, y_train=labels, x_test=big, y_test=labels)
    with pytest.raises(DataError, match=r"a\.npz \(first of 1 shards in .*\): x_train is float32"):
        Trainer(cfg(str(d)), LocalCollective(), out=io.StringIO())
    with zipfile.ZipFile(tmp_path / "mixed" / "b.npz") as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


#: ``ringtrain ARGS`` in this interpreter, then its own peak resident MiB as stderr's last line
PEAK_PROBE = r"""
import sys
from ringtrain import cli
code = cli.main(sys.argv[1:])
hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(int(hwm.split()[1]) / 1024, file=sys.stderr)
sys.exit(code)
"""
#: the memory bound and the data set it must hold against (4x the bound, on disk)
RSS_BOUND_MIB = 320
FEATURES = 32768  # 32 KiB per example: one epoch of 1.38 GB is 656 quick steps
WIDE = json.dumps(
    {
        "class_name": "Sequential",
        "config": {
            "name": "wide",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_shape": [None, FEATURES]}},
                {"class_name": "Dense", "config": {"units": 10}},
            ],
        },
    }
)


@pytest.mark.timeout(240)
def test_a_worker_trains_an_epoch_of_shards_4x_its_memory_bound_within_it(tmp_path):
    """A real ``ringtrain worker`` reads every example of 1.38 GB of shards; its peak RSS
    (``wait4``'s ru_maxrss of that one child) stays under 320 MiB."""
    rng = np.random.default_rng(0)
    rows, shards = 1000, 42
    for i in range(shards):
        np.save(tmp_path / f"x_train-{i:03d}.npy", rng.integers(0, 2, (rows, FEATURES), np.uint8))
        np.save(tmp_path / f"y_train-{i:03d}.npy", rng.integers(0, 10, rows))
    np.save(tmp_path / "x_test-0.npy", rng.integers(0, 2, (256, FEATURES), np.uint8))
    np.save(tmp_path / "y_test-0.npy", rng.integers(0, 10, 256))
    size = sum(f.stat().st_size for f in tmp_path.glob("x_*.npy"))
    assert size > 4 * RSS_BOUND_MIB * 2**20
    argv = ["--data", str(tmp_path / "*.npy"), "--model", WIDE, "--epochs", "1"]
    argv += ["--batch-size", "64", "--optimizer", "sgd", "--lr", "0.001", "--json"]
    # the worker in a fresh interpreter that reports its own peak (VmHWM) at the end: a child's
    # ru_maxrss counts the parent's resident memory when it was spawned (vfork shares the
    # parent's pages until exec), and pytest's process grows with the tests before this one
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.run(
            [sys.executable, "-c", PEAK_PROBE, "worker", *argv], stdout=out, stderr=err, check=False
        )
    assert p.returncode == 0, (tmp_path / "err").read_text()[-2000:]
    final = json.loads((tmp_path / "out").read_text().splitlines()[-1])
    assert final["steps"] == rows * shards // 64 and final["epoch"] == 1
    peak_mib = float((tmp_path / "err").read_text().strip().splitlines()[-1])
    assert peak_mib < RSS_BOUND_MIB, f"peak RSS {peak_mib:.0f} MiB over {size / 2**30:.2f} GiB"
    for f in tmp_path.glob("*.npy"):
        f.unlink()
