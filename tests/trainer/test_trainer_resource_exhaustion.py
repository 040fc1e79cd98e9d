"""Issue 20, item 3: running out of a resource (descriptors, disk) is named and retryable, never
taken for the user's permanent error.

1,500 idle connections to a worker's ring port at the common 1024 open-files limit made the
chief's next checkpoint write fail with EMFILE: exit 1, which the ExitCode policy treats as
permanent. Here a real ``ringtrain worker`` runs with so few descriptors (6) that its checkpoint
write at step 3 is the open that fails."""

from __future__ import annotations

import errno
import resource
import subprocess
import sys

import pytest

from ringtrain.errors import (
    EXIT_PERMANENT,
    EXIT_RETRYABLE,
    CheckpointError,
    InvalidSpec,
    describe,
    exit_code_for,
)

WORKER = [sys.executable, "-m", "ringtrain.cli", "worker", "--dataset", "mnist-5k", "--json"]


def test_a_checkpoint_write_out_of_descriptors_is_named_and_retryable(tmp_path):
    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (6, 6))

    out = subprocess.run(
        [
            *WORKER,
            *("--steps", "3", "--batch-size", "8", "--checkpoint-dir", str(tmp_path / "c")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=few_descriptors,
    )
    assert out.returncode != 0, "6 descriptors were enough: lower the limit of this test"
    assert "resource exhausted (EMFILE: Too many open files), retryable" in out.stderr
    assert out.returncode == EXIT_RETRYABLE, out.stderr[-2000:]
    assert "ckpt-0000000003" in out.stderr  # the checkpoint write, as in the issue


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT])
def test_exhaustion_is_retryable_even_wrapped_in_a_permanent_error(code):
    try:
        try:
            raise OSError(code, "no more")
        except OSError as e:
            raise CheckpointError("cannot write /c/ckpt-3") from e
    except CheckpointError as wrapped:
        assert exit_code_for(wrapped) == EXIT_RETRYABLE
        assert describe(wrapped).startswith(f"resource exhausted ({errno.errorcode[code]}: ")
    assert exit_code_for(InvalidSpec("x")) == EXIT_PERMANENT
    assert exit_code_for(OSError(errno.EACCES, "denied")) == 1
