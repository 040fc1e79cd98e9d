"""Writing a file so that a reader sees the old content or the new, never half of either.

Why one function: checkpoints, the chief's "training done" record, the checkpoint directory's
owner file and the ``.keras``/ONNX exports are all read by another process (a restarted worker,
the evaluator, a second job, the user) that may look at any moment, and a crash or a full disk
mid-write must not leave a truncated file under the real name. The recipe is the usual one:
write a temporary file beside the target, flush and fsync it, rename it over the target (atomic
on POSIX within one directory), then fsync the directory so the rename itself survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """The hidden temporary file beside ``path`` that :func:`atomic_write` renames into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably. On failure (a full disk: ENOSPC) the
    temporary file is removed and the OSError propagates, so callers can name the file and
    ``errors.exit_code_for`` still sees the exhaustion."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path
