"""Before any step: can the chief write what the run will write? Checked, not hoped.

Pipeline position: ``worker.Trainer`` calls :func:`check_outputs` before it loads data,
compiles or trains. An export path that could not be written used to fail the job after all
of its training (issue 20); a checkpoint directory that could not be created failed with a
bare ``PermissionError`` traceback (exit 1). Now either is ``InvalidSpec`` (exit 2, permanent)
naming the flag and the directory, before the first step. Only the chief writes either.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ringtrain.errors import InvalidSpec


def export_path(export: str, checkpoint_dir: str | None) -> Path:
    """``--export``'s file: a relative path is under the checkpoint directory, and stays there
    (``../../x.keras`` would write beside the volume, wherever that is: refused)."""
    path = Path(export)
    if path.is_absolute():
        return path
    if ".." in path.parts:
        raise InvalidSpec(
            f"--export {export}: a relative path is under the checkpoint directory and may not "
            "leave it ('..'); give an absolute path to write elsewhere"
        )
    return Path(checkpoint_dir or ".") / path


def _unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (made if missing, as the writers do)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".ringtrain-write-check-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return f"cannot write there ({type(e).__name__}: {e.strerror or e})"
    return None


def check_outputs(cfg, is_chief: bool) -> None:
    """Refuse, before training, a checkpoint directory or export path the chief cannot write.
    ``cfg``: the worker's ``TrainerConfig``."""
    if not is_chief:
        return
    targets = []
    if cfg.checkpoint_dir:
        targets.append(("--checkpoint-dir", Path(cfg.checkpoint_dir)))
    if cfg.export:
        path = export_path(cfg.export, cfg.checkpoint_dir)
        if path.is_dir():
            raise InvalidSpec(f"--export {path}: is a directory; give the model file's path")
        targets.append(("--export", path.parent))
    for flag, directory in targets:
        if (why := _unwritable(directory)) is not None:
            raise InvalidSpec(
                f"{flag}: {directory}: {why}; checked before training, so no step is lost"
            )
