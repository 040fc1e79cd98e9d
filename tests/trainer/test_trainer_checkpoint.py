import io
import json
import os

import numpy as np
import pytest

from ringtrain.errors import CheckpointError
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.dataset import Position
from ringtrain_trainer.worker import Trainer


def state(step, rng):
    return TrainingState(
        step=step,
        position=Position(1, step, 64),
        params=rng.normal(size=100).astype(np.float32),
        optimizer="adam",
        optimizer_state={
            "m": rng.normal(size=100).astype(np.float32),
            "v": rng.random(100).astype(np.float32),
        },
        optimizer_iterations=step,
        loss=0.5,
    )


def test_save_is_atomic_and_keeps_the_last_k(tmp_path, rng):
    m = CheckpointManager(tmp_path, keep=2)
    saved = [state(s, rng) for s in (10, 20, 30)]
    for s in saved:
        m.save(s)
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "ckpt-0000000020.json",
        "ckpt-0000000020.npz",
        "ckpt-0000000030.json",
        "ckpt-0000000030.npz",
    ]  # no temporary files left behind
    got, skipped = m.load_latest()
    assert skipped == [] and got.step == 30 and got.position == Position(1, 30, 64)
    np.testing.assert_array_equal(got.params, saved[-1].params)
    np.testing.assert_array_equal(got.optimizer_state["v"], saved[-1].optimizer_state["v"])
    manifest = json.loads((tmp_path / "ckpt-0000000030.json").read_text())
    assert len(manifest["arrays"]["sha256"]) == 64


def test_an_npz_without_manifest_is_not_a_checkpoint(tmp_path, rng):
    m = CheckpointManager(tmp_path)
    m.save(state(1, rng))
    (tmp_path / "ckpt-0000000002.npz").write_bytes(b"half written")
    assert m.load_latest()[0].step == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_checkpoint_is_named_and_the_previous_one_used(tmp_path, rng, damage):
    m = CheckpointManager(tmp_path, keep=3)
    first = state(1, rng)
    m.save(first)
    m.save(state(2, rng))
    npz, man = tmp_path / "ckpt-0000000002.npz", tmp_path / "ckpt-0000000002.json"
    if damage == "flip":
        b = bytearray(npz.read_bytes())
        b[len(b) // 2] ^= 0xFF
        npz.write_bytes(bytes(b))
    elif damage == "truncate":
        npz.write_bytes(npz.read_bytes()[:100])
    else:
        man.write_text("{not json")
    got, skipped = m.load_latest()
    assert got.step == 1
    np.testing.assert_array_equal(got.params, first.params)
    assert len(skipped) == 1
    named = str(man) if damage == "manifest" else str(npz)
    assert named in str(skipped[0])
    with pytest.raises(CheckpointError, match=r"checksum mismatch|unreadable manifest"):
        m.load(man)


def test_no_usable_checkpoint_is_an_error_not_a_silent_restart(tmp_path, rng):
    m = CheckpointManager(tmp_path)
    m.save(state(1, rng))
    (tmp_path / "ckpt-0000000001.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*ckpt-0000000001\.npz"):
        m.load_latest()
    assert CheckpointManager(tmp_path / "empty").load_latest() == (None, [])


def run(mnist5k, steps, ckpt=None, every=0, world_batch=16, opt="adam"):
    cfg = TrainerConfig(
        dataset="mnist-5k",
        steps=steps,
        batch_size=world_batch,
        optimizer=opt,
        lr=0.01,
        seed=5,
        checkpoint_dir=ckpt and str(ckpt),
        checkpoint_every=every,
    )
    t = Trainer(cfg, LocalCollective(), mnist5k, out=io.StringIO())
    try:
        final = t.run()
    finally:
        t.close()
    return t, final


@pytest.mark.parametrize("opt", ["adam"])
def test_resume_is_exact(tmp_path, mnist5k, opt):
    # 260 steps of batch 16 cross the 250-step epoch boundary, so the data position matters
    straight, _ = run(mnist5k, 260, opt=opt)
    _first, f1 = run(mnist5k, 130, tmp_path, every=65, opt=opt)
    assert f1["checkpoint"].endswith("ckpt-0000000130.json")
    resumed, f2 = run(mnist5k, 260, tmp_path, opt=opt)
    assert f2["steps"] == 260 and resumed.position == straight.position
    np.testing.assert_array_equal(resumed.params, straight.params)
    for k, v in straight.optimizer.state.items():
        np.testing.assert_array_equal(resumed.optimizer.state[k], v)


def test_checkpoint_written_by_two_workers_resumes_on_one(tmp_path, mnist5k):
    import threading

    from thread_collective import ThreadGroup

    cols = ThreadGroup(2).collectives()
    cfg = TrainerConfig(
        dataset="mnist-5k", steps=4, batch_size=8, lr=0.01, seed=5, checkpoint_dir=str(tmp_path)
    )
    trainers = [Trainer(cfg, c, mnist5k, out=io.StringIO()) for c in cols]
    threads = [threading.Thread(target=t.run) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in trainers:
        t.close()
    m = json.loads((tmp_path / "ckpt-0000000004.json").read_text())
    assert (m["world_size"], m["global_batch"]) == (2, 16)
    one, final = run(mnist5k, 6, tmp_path, world_batch=16)
    assert final["steps"] == 6 and one.position == Position(0, 6, 16)


def test_only_the_chief_needs_the_checkpoint_directory(tmp_path, mnist5k):
    import threading

    from thread_collective import ThreadGroup

    _, _first = run(mnist5k, 3, tmp_path / "chief", world_batch=16)
    cols = ThreadGroup(2).collectives()
    dirs = [tmp_path / "chief", tmp_path / "empty-on-worker-1"]
    trainers = [
        Trainer(
            TrainerConfig(
                dataset="mnist-5k", steps=5, batch_size=8, lr=0.01, seed=5, checkpoint_dir=str(d)
            ),
            c,
            mnist5k,
            out=io.StringIO(),
        )
        for c, d in zip(cols, dirs, strict=True)
    ]
    finals = [None, None]

    def go(i):
        finals[i] = trainers[i].run()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in trainers:
        t.close()
    assert [f["steps"] for f in finals] == [5, 5]  # both resumed at step 3, ran 2 more
    np.testing.assert_array_equal(trainers[0].params, trainers[1].params)
    assert not (tmp_path / "empty-on-worker-1").exists()  # never read, never written
