"""The checkpoint directory's owner is a lease, and its control files are read bounded and
written without following a link (issue 35).

Before: the owner file held a pid that any process on a host of the same name checked with
``kill(pid, 0)``, so a second job in another PID namespace (a container with the host's name,
``unshare -p``) saw no such process and took over a live directory; a 3 GB owner file (or done
marker) was read whole; the owner file's temporary name ``.<name>.tmp-<pid>`` was opened
following a symbolic link planted there; a done marker that was a FIFO hung the evaluator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ringtrain import files
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.checkpoint import owner as ckpt_owner
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.data.dataset import Position

CLAIM = textwrap.dedent(
    """
    import sys
    from ringtrain.errors import InvalidSpec
    from ringtrain_trainer.checkpoint import owner
    try:
        owner.claim(sys.argv[1], sys.argv[2].encode() or None)
    except InvalidSpec as e:
        print("REFUSED", e)
        sys.exit(2)
    print("CLAIMED")
    """
)


def other_namespace(*args: str) -> subprocess.CompletedProcess:
    """``python -c CLAIM args`` as PID 1 of a new PID namespace (same host name, same files)."""
    cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", CLAIM, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-p", "-f", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def record(token: bytes | None, pid: int, expires_in: float, pidns: str | None) -> dict:
    return {
        "job": ckpt_owner.job_id(token),
        "lease": "f" * 32,
        "host": "elsewhere",
        "pid": pid,
        "pidns": pidns,
        "since": "x",
        "expires": time.time() + expires_in,
    }


def plant(ck, rec: dict) -> None:
    (ck / ckpt_owner.OWNER_FILE).write_text(json.dumps(rec))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not unshare_works(), reason="needs unshare --pid (root or user namespaces)")
@pytest.mark.parametrize("second", ["B", ""], ids=["another job", "a token-less chief"])
def test_a_second_job_in_another_pid_namespace_is_refused_a_live_directory(tmp_path, second):
    lease = ckpt_owner.claim(tmp_path, b"A")  # the first job: this process, alive
    try:
        p = other_namespace(str(tmp_path), second)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"--checkpoint-dir {tmp_path}: in use by another job" in p.stdout
        assert f"job {ckpt_owner.job_id(b'A')}" in p.stdout and f"pid {os.getpid()}" in p.stdout
        assert json.loads((tmp_path / ckpt_owner.OWNER_FILE).read_text())["pid"] == os.getpid()
        same_job = other_namespace(str(tmp_path), "A")  # a restart of job A: at once
        assert same_job.returncode == 0, same_job.stdout + same_job.stderr
    finally:
        ckpt_owner.release(lease)


def test_a_live_lease_holds_whatever_its_pid_and_a_stale_one_is_taken_over(tmp_path):
    gone = 2**22 + 12345  # no such process here; meaningless in another namespace anyway
    plant(tmp_path, record(b"A", gone, 30, "another-boot/0:1"))
    with pytest.raises(InvalidSpec, match="in use by another job"):
        ckpt_owner.claim(tmp_path, b"B")
    with pytest.raises(InvalidSpec, match="in use by another job"):
        ckpt_owner.claim(tmp_path, None)
    stale = -(ckpt_owner.SKEW_S + 1)
    plant(tmp_path, record(b"A", gone, stale, "another-boot/0:1"))
    lease = ckpt_owner.claim(tmp_path, b"B")
    assert json.loads(lease.path.read_text())["job"] == ckpt_owner.job_id(b"B")
    lease.release()
    # within the skew allowance it still holds: another host's clock may run behind
    plant(tmp_path, record(b"A", gone, -1, None))
    with pytest.raises(InvalidSpec, match="lease until"):
        ckpt_owner.claim(tmp_path, b"B")


def test_an_owner_file_with_an_unbelievable_expiry_is_not_a_claim(tmp_path, capsys):
    for expires in [1e300, float("inf"), "soon", True]:
        rec = record(b"A", 1, 0, None)
        rec["expires"] = expires
        (tmp_path / ckpt_owner.OWNER_FILE).write_text(json.dumps(rec))
        ckpt_owner.claim(tmp_path, b"B").release()
        assert "no believable lease expiry; taken over" in capsys.readouterr().err


def test_the_lease_is_renewed_while_held_and_dropped_on_release(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_owner, "RENEW_S", 0.05)
    lease = ckpt_owner.claim(tmp_path, b"A")
    first = json.loads(lease.path.read_text())["expires"]
    deadline = time.monotonic() + 10
    while json.loads(lease.path.read_text())["expires"] == first:  # a live thread renewing
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.05)
    lease.release()
    assert not lease.path.exists()
    assert lease._thread is not None and not lease._thread.is_alive()


def state(step: int) -> TrainingState:
    return TrainingState(
        step=step, position=Position(0, step, 64), params=np.zeros(10, np.float32), optimizer="sgd"
    )


def test_a_chief_whose_lease_was_taken_over_writes_no_checkpoint(tmp_path):
    """The first job stalled past its lease and a second took the directory: the first one's
    next checkpoint (and so its result) is refused, naming the new owner."""
    lease = ckpt_owner.claim(tmp_path, b"A")
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1))  # renews: still ours
    plant(tmp_path, record(b"B", 1, 60, None))
    with pytest.raises(
        InvalidSpec, match=f"taken over by another job \\(job {ckpt_owner.job_id(b'B')}"
    ):
        mgr.save(state(2))
    assert [p.name for p in mgr.manifests()] == ["ckpt-0000000001.json"]
    lease.release()
    assert (tmp_path / ckpt_owner.OWNER_FILE).exists()  # not ours to remove


# -- bounded, no-follow reads and writes of the control files ---------------------------------

LIMITED = textwrap.dedent(
    """
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))  # a 3 GB read cannot fit
    from ringtrain_trainer.checkpoint import owner
    from ringtrain_trainer import evaluator
    t0 = time.monotonic()
    owner.claim(sys.argv[1], b"A").release()
    assert evaluator.read_done(sys.argv[1]) is None
    print("DONE in", time.monotonic() - t0)
    """
)


@pytest.mark.timeout(60)
def test_a_3gb_owner_file_or_done_marker_is_refused_unread_and_named(tmp_path):
    """In a child limited to 1.5 GiB of address space: before, a MemoryError traceback."""
    from ringtrain_trainer import evaluator

    for name in (ckpt_owner.OWNER_FILE, evaluator.DONE_FILE):
        with open(tmp_path / name, "wb") as f:
            f.truncate(3 << 30)  # sparse: no disk, 3 GB to read
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", LIMITED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 0 and "DONE in" in p.stdout, p.stderr[-2000:]
    assert float(p.stdout.split()[-1]) < 1
    owner_file, marker = tmp_path / ckpt_owner.OWNER_FILE, tmp_path / evaluator.DONE_FILE
    assert f"{owner_file}: 3221225472 bytes, larger than the cap of 65536 bytes" in p.stderr
    assert f"{marker}: 3221225472 bytes, larger than the cap of 1048576 bytes" in p.stderr


@pytest.mark.timeout(30)
def test_a_fifo_done_marker_is_refused_and_named_once(tmp_path, capsys):
    from ringtrain_trainer import evaluator

    marker = tmp_path / evaluator.DONE_FILE
    os.mkfifo(marker)  # read whole, this hung the evaluator: no writer ever comes
    assert evaluator.read_done(tmp_path) is None
    assert f"{marker}: a FIFO; refused" in capsys.readouterr().err
    assert evaluator.read_done(tmp_path) is None
    assert capsys.readouterr().err == ""  # named once, not at every poll


def test_the_owner_files_temporary_name_is_never_followed(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    # the name the temporary file had: .<name>.tmp-<pid>
    (ck / f".{ckpt_owner.OWNER_FILE}.tmp-{os.getpid()}").symlink_to(victim)
    lease = ckpt_owner.claim(ck, b"A")
    assert victim.read_text() == "keep me"
    assert not lease.path.is_symlink() and json.loads(lease.path.read_text())["job"]
    lease.release()


def test_atomic_write_never_writes_through_anything_planted_at_its_temporary_name(
    tmp_path, monkeypatch
):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "owner.json"
    names = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(files, "_nonce", lambda: next(names))
    files.temporary_name(target, "aaaa").symlink_to(victim)  # guessed, somehow
    files.atomic_write(target, b"{}")
    assert victim.read_text() == "keep me" and target.read_bytes() == b"{}"
    monkeypatch.setattr(files, "_nonce", lambda: "aaaa")  # every name taken: refused, named
    with pytest.raises(FileExistsError, match="temporary names beside it were all taken"):
        files.atomic_write(target, b"[]")
    assert victim.read_text() == "keep me" and target.read_bytes() == b"{}"


def test_an_owner_file_or_done_marker_that_is_a_link_is_not_read_through(tmp_path, capsys):
    from ringtrain_trainer import evaluator

    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps(record(b"A", 1, 60, None)))  # a live claim, if followed
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ckpt_owner.OWNER_FILE).symlink_to(victim)
    ckpt_owner.claim(ck, b"B").release()
    assert "a symbolic link; refused" in capsys.readouterr().err
    assert json.loads(victim.read_text())["job"] == ckpt_owner.job_id(b"A")
    (ck / evaluator.DONE_FILE).symlink_to(victim)
    assert evaluator.read_done(ck) is None
    assert "a symbolic link; refused" in capsys.readouterr().err


def test_a_chief_that_re_executed_itself_takes_its_own_claim_at_once(tmp_path):
    """A rejoin re-executes the worker in place (same pid, a fresh interpreter holding no
    lease): its earlier claim is its own, not a live owner to wait for."""
    plant(tmp_path, record(None, os.getpid(), 60, ckpt_owner.pid_namespace()))
    t0 = time.monotonic()
    ckpt_owner.claim(tmp_path, None).release()
    assert time.monotonic() - t0 < 1
