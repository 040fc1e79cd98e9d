"""Issue 20, item 8: an output path that cannot be written fails the job before training.

Real ``ringtrain worker`` processes. A path under a regular *file* cannot be created by anyone,
root included (the tests may run as root, for whom permission bits do not count). Before, the
run trained every step and then failed writing the export (exit 1, a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringtrain.errors import EXIT_PERMANENT

WORKER = [sys.executable, "-m", "ringtrain.cli", "worker", "--dataset", "mnist-5k", "--json"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (lambda f, d: ["--checkpoint-dir", str(d), "--export", f"{f}/model.keras"], "--export"),
        (lambda f, d: ["--checkpoint-dir", f"{f}/ckpt"], "--checkpoint-dir"),
        (lambda f, d: ["--checkpoint-dir", str(d), "--export", str(f.parent)], "is a directory"),
    ],
    ids=["export under a file", "checkpoint dir under a file", "export is a directory"],
)
def test_an_unwritable_output_fails_before_the_first_step(tmp_path, flags, named):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = subprocess.run(
        [*WORKER, "--steps", "200", "--batch-size", "8", *flags(blocker, tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_PERMANENT, out.stderr[-2000:]
    assert "InvalidSpec" in out.stderr and named in out.stderr
    assert "checked before training" in out.stderr or "is a directory" in out.stderr
    events = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert not [e for e in events if e.get("event") in ("progress", "final")], events[:3]


def test_writable_outputs_train_and_export(tmp_path):
    out = subprocess.run(
        [
            *WORKER,
            *("--steps", "2", "--batch-size", "8", "--checkpoint-dir", str(tmp_path / "c")),
            *("--export", "deep/er/model.keras"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "c" / "deep" / "er" / "model.keras").is_file()
    assert not list((tmp_path / "c").rglob(".ringtrain-write-check-*"))


def test_a_relative_export_that_leaves_the_checkpoint_directory_is_refused(tmp_path):
    """Before (issue 35): ``--export ../../x.keras`` wrote beside the checkpoint volume."""
    ckpt = tmp_path / "vol" / "ckpt"
    out = subprocess.run(
        [
            *WORKER,
            *("--steps", "2", "--batch-size", "8", "--checkpoint-dir", str(ckpt)),
            *("--export", "../../x.keras"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_PERMANENT, out.stderr[-2000:]
    assert "--export ../../x.keras: a relative path is under the checkpoint directory" in out.stderr
    assert not (tmp_path / "x.keras").exists()
    events = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert not [e for e in events if e.get("event") in ("progress", "final")], events[:3]
