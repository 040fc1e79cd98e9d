"""Checkpoints read and written defensively (issue 20): forged files are refused by name, an
intact but wrong checkpoint falls back to the previous good one, a full disk is named and
retryable with no ``.tmp`` left, and one job owns a checkpoint directory.

Before: a forged ``.npz`` that was a FIFO hung the chief in ``open``, one that linked to
``/dev/zero`` was read until memory ran out, a manifest could name a file outside its
directory; a checksum-valid checkpoint of another shape crashed the resume (exit 2, no
fallback); ENOSPC left the ``.tmp`` behind and named no file; two jobs shared a directory."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from support.procs import WORKER, new_token, without_cluster

from ringtrain.errors import EXIT_PERMANENT, EXIT_RETRYABLE, InvalidSpec
from ringtrain_trainer.checkpoint import owner as ckpt_owner
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.data.dataset import Position


def state(step: int, n: int = 500) -> TrainingState:
    rng = np.random.default_rng(step)
    return TrainingState(
        step=step,
        position=Position(0, step, 64),
        params=rng.random(n).astype(np.float32),
        optimizer="sgd",
        optimizer_iterations=step,
    )


def forge(directory, step: int, npz_name: str, blob: bytes) -> None:
    """A manifest for step ``step`` whose checksum matches ``blob`` and names ``npz_name``."""
    manifest = {
        "format": 1,
        "step": step,
        "epoch": 0,
        "batch": step,
        "global_batch": 64,
        "model": "cnn",
        "optimizer": "sgd",
        "optimizer_iterations": step,
        "world_size": 1,
        "arrays": {
            "file": npz_name,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
            "names": ["params"],
        },
    }
    (directory / f"ckpt-{step:010d}.json").write_text(json.dumps(manifest))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "outside", "oversized"])
def test_a_forged_checkpoint_is_refused_by_name_and_the_previous_one_used(tmp_path, kind):
    ck = tmp_path / "ck"
    mgr = CheckpointManager(ck, keep=5)
    mgr.save(state(2))
    good = (ck / "ckpt-0000000002.npz").read_bytes()
    npz = ck / "ckpt-0000000004.npz"
    if kind == "fifo":
        os.mkfifo(npz)
        forge(ck, 4, npz.name, good)
    elif kind == "link to /dev/zero":
        npz.symlink_to("/dev/zero")
        forge(ck, 4, npz.name, good)
    elif kind == "outside":
        (tmp_path / "outside.npz").write_bytes(good)
        forge(ck, 4, "../outside.npz", good)
    else:
        npz.write_bytes(good + b"\0" * (len(good) + 1))
        forge(ck, 4, npz.name, good)
        mgr = CheckpointManager(ck, keep=5, max_bytes=2 * len(good))
    t0 = time.monotonic()
    got, skipped = mgr.load_latest()
    assert time.monotonic() - t0 < 2
    assert got is not None and got.step == 2
    assert len(skipped) == 1
    msg = str(skipped[0])
    assert "ckpt-0000000004" in msg, msg
    want = {
        "fifo": "a FIFO; refused",
        "link to /dev/zero": "a symbolic link; refused",
        "outside": "names '../outside.npz'",
        "oversized": "larger than the cap",
    }[kind]
    assert want in msg, msg


def worker(ck, steps: int, *extra: str, token: str | None = None, **kw):
    env = without_cluster()
    if token:
        env["RINGTRAIN_TOKEN"] = token
    args = [*WORKER, "--dataset", "mnist-5k", "--steps", str(steps), "--batch-size", "16"]
    args += ["--seed", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--json"]
    return subprocess.run(
        [*args, *extra], capture_output=True, text=True, timeout=120, env=env, **kw
    )


def test_an_intact_checkpoint_of_another_shape_falls_back_to_the_previous_good_one(tmp_path):
    """A real worker: checkpoint 4 is replaced by a checksum-valid one of 10 parameters (the
    cnn has 347,146); the resume names it, skips it and starts from step 3."""
    ck = tmp_path / "ck"
    first = worker(ck, 4)
    assert first.returncode == 0, first.stderr[-2000:]
    (ck / "ckpt-0000000004.json").unlink()
    (ck / "ckpt-0000000004.npz").unlink()
    CheckpointManager(ck, keep=5).save(state(4, n=10))
    resumed = worker(ck, 6)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipping corrupt checkpoint" in resumed.stderr
    assert f"{ck / 'ckpt-0000000004.npz'}: checkpoint of model" in resumed.stderr
    steps = [json.loads(x).get("step") for x in resumed.stdout.splitlines()]
    assert steps[0] == 3, resumed.stdout[:500]


def test_a_full_disk_names_the_checkpoint_removes_its_tmp_and_is_retryable(tmp_path):
    """A real worker whose checkpoint directory is a 64 KiB tmpfs (its own mount namespace):
    the first checkpoint (1.4 MB) hits a real ENOSPC."""
    ck = tmp_path / "ck"
    ck.mkdir()
    cmd = " ".join(
        [
            f"mount -t tmpfs -o size=64k tmpfs {ck} &&",
            f"{' '.join(WORKER)} --dataset mnist-5k --steps 2 --batch-size 16",
            f"--checkpoint-dir {ck} --checkpoint-every 2;",
            f'rc=$?; echo "LEFT: $(ls -A {ck})" >&2; exit $rc',
        ]
    )
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env=without_cluster(),
    )
    assert p.returncode == EXIT_RETRYABLE, p.stderr[-2000:]
    assert "resource exhausted (ENOSPC: No space left on device), retryable" in p.stderr
    assert f"{ck / 'ckpt-0000000002.npz'}: cannot write" in p.stderr, p.stderr[-2000:]
    left = p.stderr.rsplit("LEFT:", 1)[1].split()
    assert not [n for n in left if ".tmp" in n], left


@pytest.mark.slow  # three real workers: 31 s on the loaded 2-core machine
def test_a_second_job_is_refused_a_checkpoint_directory_in_use_naming_its_owner(tmp_path):
    ck = tmp_path / "ck"
    a, b = new_token(), new_token()
    env = dict(without_cluster(), RINGTRAIN_TOKEN=a)
    args = [*WORKER, "--dataset", "mnist-5k", "--steps", "100000", "--batch-size", "16"]
    first = subprocess.Popen(
        [*args, "--checkpoint-dir", str(ck)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        owner_file = ck / ckpt_owner.OWNER_FILE
        deadline = time.monotonic() + 60
        while not owner_file.exists():  # polling a live process, not standing in for sync
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        second = worker(ck, 2, token=b)
        assert second.returncode == EXIT_PERMANENT, second.stderr[-2000:]
        assert f"--checkpoint-dir {ck}: in use by another job" in second.stderr
        assert f"job {ckpt_owner.job_id(a.encode())}" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        restarted = worker(ck, 2, token=a)  # the same job (its token) takes it over
        assert restarted.returncode == 0, restarted.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert not owner_file.exists()  # the restart released its claim when it ended


def record(token: bytes | None, pid: int, expires_in: float = 60.0) -> dict:
    """An owner record of a live lease held by ``pid`` in this PID namespace."""
    return {
        "job": ckpt_owner.job_id(token),
        "lease": "0" * 32,
        "host": "here",
        "pid": pid,
        "pidns": ckpt_owner.pid_namespace(),
        "since": "x",
        "expires": time.time() + expires_in,
    }


def test_the_owner_file_is_taken_over_by_the_same_job_or_a_dead_claim_and_refused_otherwise(
    tmp_path,
):
    ck = tmp_path
    (ck / ckpt_owner.OWNER_FILE).write_text(
        json.dumps({"job": ckpt_owner.job_id(b"A"), "host": "node-7", "pid": 1, "since": "x"})
    )
    with pytest.raises(InvalidSpec, match="host node-7, pid 1"):
        ckpt_owner.claim(ck, b"B")
    ckpt_owner.release(ckpt_owner.claim(ck, b"A"))  # a restart of job A on another node
    (ck / ckpt_owner.OWNER_FILE).write_text(json.dumps(record(b"A", 2**22 + 12345)))
    lease = ckpt_owner.claim(ck, b"B")  # its process is gone from this PID namespace
    assert json.loads(lease.path.read_text())["pid"] == os.getpid()
    ckpt_owner.release(lease)
    assert not lease.path.exists()


def test_a_token_less_chief_takes_over_from_a_predecessor_that_exits_and_not_from_one_that_stays(
    tmp_path, monkeypatch
):
    """A restarted MPI rank 0 (no ring token) can start while mpirun still reaps the rank it
    replaces: it waits for that process (at most ``STALE_WAIT_S``), then claims; a token-less
    owner that stays alive is still refused."""
    import sys
    import threading

    from ringtrain.errors import InvalidSpec
    from ringtrain_trainer.checkpoint import owner as ckpt_owner

    def owner(pid: int) -> None:
        (tmp_path / ckpt_owner.OWNER_FILE).write_text(json.dumps(record(None, pid)))

    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    owner(dying.pid)
    reaper = threading.Thread(target=dying.wait)
    reaper.start()
    lease = ckpt_owner.claim(tmp_path, None)
    reaper.join()
    assert json.loads(lease.path.read_text())["pid"] == os.getpid()
    lease.release()

    staying = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        owner(staying.pid)
        monkeypatch.setattr(ckpt_owner, "STALE_WAIT_S", 0.3)
        with pytest.raises(InvalidSpec, match="in use by another job"):
            ckpt_owner.claim(tmp_path, None)
    finally:
        staying.stdin.close()
        staying.wait()
