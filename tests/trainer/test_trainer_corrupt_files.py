"""Corrupt or truncated data sets and checkpoints: named in the error, and a bad checkpoint falls
back to the previous good one (the cases test_trainer_checkpoint/test_trainer_data/test_data_npz
do not already cover: cuts in the middle and at the last byte, and a real worker resuming)."""

from __future__ import annotations

import gzip
import json
import subprocess

import numpy as np
import pytest
from support.procs import WORKER

from ringtrain.errors import EXIT_PERMANENT, DataError
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.data import dataset as D
from ringtrain_trainer.data.dataset import Position
from ringtrain_trainer.data.npz import load_npz

CUTS = {"half": lambda n: n // 2, "last byte": lambda n: n - 1, "first byte": lambda n: 1}


def cut(path, where: str) -> None:
    b = path.read_bytes()
    path.write_bytes(b[: CUTS[where](len(b))])


def state(step: int, rng) -> TrainingState:
    return TrainingState(
        step=step,
        position=Position(0, step, 64),
        params=rng.random(5000).astype(np.float32),
        optimizer="adam",
        optimizer_state={"m": rng.random(5000).astype(np.float32)},
        optimizer_iterations=step,
        loss=0.5,
    )


@pytest.mark.parametrize("where", CUTS)
def test_a_checkpoint_cut_mid_file_falls_back_to_the_previous(tmp_path, where):
    rng = np.random.default_rng(0)
    m = CheckpointManager(tmp_path, keep=3)
    good = state(2, rng)
    m.save(good)
    m.save(state(4, rng))
    cut(tmp_path / "ckpt-0000000004.npz", where)
    got, skipped = m.load_latest()
    assert got.step == 2 and np.array_equal(got.params, good.params)
    assert [str(tmp_path / "ckpt-0000000004.npz") in str(s) for s in skipped] == [True]


@pytest.mark.parametrize("where", CUTS)
def test_a_npz_data_set_cut_mid_file_is_named(tmp_path, where):
    p = tmp_path / "data.npz"
    np.savez(
        p,
        x_train=np.zeros((64, 28, 28), np.uint8),
        y_train=np.zeros(64, np.uint8),
        x_test=np.zeros((8, 28, 28), np.uint8),
        y_test=np.zeros(8, np.uint8),
    )
    cut(p, where)
    with pytest.raises(DataError) as e:
        load_npz(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
@pytest.mark.parametrize("where", CUTS)
def test_an_idx_file_cut_mid_file_is_named(tmp_path, where, gz):
    a = np.zeros((100, 28, 28), np.uint8)
    raw = b"\x00\x00\x08\x03" + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()
    p = tmp_path / ("images-idx3-ubyte" + (".gz" if gz else ""))
    p.write_bytes(gzip.compress(raw) if gz else raw)
    cut(p, where)
    with pytest.raises(DataError) as e:
        D.read_idx(p)
    assert str(p) in str(e.value)


def worker(tmp_path, steps: int, ck: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *WORKER,
            "--dataset",
            "mnist-5k",
            "--steps",
            str(steps),
            "--batch-size",
            "16",
            "--seed",
            "3",
            "--checkpoint-dir",
            str(tmp_path / ck),
            "--checkpoint-every",
            "2",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def final(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_worker_resumes_from_the_last_good_checkpoint_and_ends_where_an_undisturbed_run_does(
    tmp_path,
):
    undisturbed = final(worker(tmp_path, 6, "a"))
    final(worker(tmp_path, 4, "b"))
    cut(tmp_path / "b" / "ckpt-0000000004.npz", "half")  # the newest, cut mid-file
    resumed = worker(tmp_path, 6, "b")
    assert "skipping corrupt checkpoint" in resumed.stderr
    assert str(tmp_path / "b" / "ckpt-0000000004.npz") in resumed.stderr
    steps = [
        json.loads(x)["step"]
        for x in resumed.stdout.splitlines()
        if json.loads(x).get("event") == "progress"
    ]
    assert steps[0] == 3  # from the checkpoint of step 2, not from 0
    assert final(resumed)["loss"] == undisturbed["loss"]
    with (
        np.load(tmp_path / "a" / "ckpt-0000000006.npz") as a,
        np.load(tmp_path / "b" / "ckpt-0000000006.npz") as b,
    ):
        np.testing.assert_array_equal(a["params"], b["params"])


def test_a_worker_given_a_truncated_data_set_exits_2_naming_it(tmp_path):
    p = tmp_path / "data.npz"
    np.savez(
        p,
        x_train=np.zeros((64, 28, 28), np.uint8),
        y_train=np.zeros(64, np.uint8),
        x_test=np.zeros((8, 28, 28), np.uint8),
        y_test=np.zeros(8, np.uint8),
    )
    cut(p, "half")
    out = subprocess.run(
        [
            *WORKER,
            "--data",
            str(p),
            "--steps",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == EXIT_PERMANENT and str(p) in out.stderr, out.stderr[-1000:]
