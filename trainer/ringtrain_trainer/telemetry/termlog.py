"""The worker's termination message: its final JSON result, written where Kubernetes reads it.

Pipeline position: the last thing ``ringtrain worker`` (trainer or evaluator) does. Kept apart
from the training loop because it must work even when the flags were invalid.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ringtrain_trainer.collective import Collective
from ringtrain_trainer.config import TrainerConfig


def write_termination_log(path: str | None, doc: dict) -> None:
    if not path:
        return
    try:
        Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    except OSError as e:
        print(f"ringtrain worker: cannot write termination log {path}: {e}", file=sys.stderr)


def own_termination_log(
    path: str | None, cfg: TrainerConfig | None, collective: Collective | None
) -> str | None:
    """``path``, or None where another process of this job writes the same file.

    Under ``mpirun`` every rank runs on the same host with the same flags, so all would write
    one path and the last writer would win; only rank 0 writes (its result is the job's). Ring
    workers run one per pod, each with its own termination log, so each writes its own. Before
    the collective exists (bad flags), Open MPI's own rank variable decides."""
    mpi = (cfg.collective == "mpi") if cfg is not None else "OMPI_COMM_WORLD_RANK" in os.environ
    if not mpi:
        return path
    rank = (
        collective.rank
        if collective is not None
        else int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    )
    return path if rank == 0 else None


def termination_log_flag(argv: list[str]) -> str | None:
    """--termination-log even when the rest of the flags are invalid, so the reason is kept."""
    ns, _ = TrainerConfig.parser().parse_known_args(
        [a for a in argv if a.startswith("--termination-log")]
        + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--termination-log"]
    )
    return ns.termination_log
