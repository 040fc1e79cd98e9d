"""Which files a data path names, for the readers that recognise a format by content.

Pipeline position: ``ringtrain data inspect|convert`` (and the trainer's refusal of data it
must not stream) ask :mod:`.tfrecord` and :mod:`.parquet` whether a path holds their files;
both list the candidates here, the same way, then keep those whose first bytes are theirs —
so the rule for a file, a directory or a glob is one rule, whatever the format.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path


def listed_files(path: str | os.PathLike) -> list[Path]:
    """The files ``path`` names, sorted: itself, a directory's own files (not its
    sub-directories') or a glob's matches; [] when it names none."""
    p = str(path)
    if any(c in p for c in "*?["):
        return sorted(Path(f) for f in glob.glob(p) if Path(f).is_file())
    if Path(p).is_dir():
        return sorted(f for f in Path(p).iterdir() if f.is_file())
    if Path(p).is_file():
        return [Path(p)]
    return []
