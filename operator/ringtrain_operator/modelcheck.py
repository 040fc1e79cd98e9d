"""Ask the trainer about a model in a bounded child process: can it run, and what does it hold.

Why a child: the answers are the worker's own arithmetic (``ringtrain_trainer.sizing``: the Keras
parser, the memory budget, the build, ``plan_memory``), which needs numpy and the engine. In the
operator's process they cost ~60 MB of imports and let one tenant's 1 KB spec allocate what its
shapes say (a free input dimension skipped the budget: 802 MiB against the chart's 256Mi). Here
the operator imports neither (tests/operator/test_operator_imports.py), and a child that
outgrows :data:`CHILD_DATA_BYTES` or :data:`CHILD_TIMEOUT_S` refuses the model, naming the limit.

Answers are cached per request: a reconcile after the first costs nothing, and the same preset
in many jobs is planned once. Measured here: one request 0.2 s, 33 MB peak RSS in the child.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from functools import lru_cache
from typing import Any

from ringtrain.errors import InvalidSpec

#: The child's data segment (heap and anonymous maps, RLIMIT_DATA): the trainer's imports take
#: ~33 MB; a model whose layout needs more than this is refused before any pod exists.
CHILD_DATA_BYTES = 192 << 20
#: A parse, budget check and build of the largest accepted inline model takes well under 1 s.
CHILD_TIMEOUT_S = 30.0
#: One BLAS thread: the child multiplies nothing, and each idle thread reserves a buffer.
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


class ModelCheckError(RuntimeError):
    """The child did not answer: killed at its limit, timed out, or crashed (message says)."""


def _limit() -> None:  # pragma: no cover - runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_DATA, (CHILD_DATA_BYTES, CHILD_DATA_BYTES))


@lru_cache(maxsize=64)  # keys hold inline configs (≤ 128 KiB each)
def _ask(request: str) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ringtrain_trainer.sizing"],
            input=request,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            preexec_fn=_limit,
            env={**os.environ, **CHILD_ENV},
            check=False,
        )
    except subprocess.TimeoutExpired:
        return json.dumps({"error": f"planning it took longer than {CHILD_TIMEOUT_S:g} s"})
    if done.returncode != 0 or not done.stdout:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        if "MemoryError" in done.stderr:
            return json.dumps({"error": _too_big()})
        raise ModelCheckError(f"ringtrain_trainer.sizing failed: {tail[0]}")
    out = json.loads(done.stdout)
    if out.get("error") == "MemoryError":
        out["error"] = _too_big()
    return json.dumps(out)


def _too_big() -> str:
    return f"planning it needs more than {CHILD_DATA_BYTES >> 20} MiB of memory"


def ask(request: dict[str, Any]) -> dict[str, Any]:
    """The child's answer to ``request`` (``ringtrain_trainer.sizing``'s protocol)."""
    result: dict[str, Any] = json.loads(_ask(json.dumps(request, sort_keys=True)))
    return result


def check(model: Any, capacity: int, per_ipu: int) -> str | None:
    """Why the inline Keras config ``model`` cannot run within ``capacity`` bytes per IPU at
    ``per_ipu`` examples, or None."""
    why = ask({"check": {"model": model, "capacity": capacity, "per_ipu": per_ipu}})["error"]
    return None if why is None else str(why)


def plan(
    model: Any, per_ipu: int, capacity: int, optimizer: str | None, on_host: bool
) -> tuple[int | None, int, int]:
    """(one IPU's planned bytes or None when only the pod can plan it, parameters, optimizer
    state arrays per parameter)."""
    a = ask(
        {
            "plan": {
                "model": model,
                "per_ipu": per_ipu,
                "capacity": capacity,
                "optimizer": optimizer,
                "on_host": on_host,
            }
        }
    )
    if a.get("error"):
        raise InvalidSpec(str(a["error"]))
    return a["plan"], int(a["params"]), int(a["slots"])
