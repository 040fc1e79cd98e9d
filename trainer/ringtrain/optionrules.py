"""Rules on option values that a schema keyword cannot state, in one place for both sides.

The CRD checks ``trace.steps`` against ``^[0-9]+(-[0-9]+)?$`` and ``pipeline.stages`` not at
all, while the worker refused ``0-3``, ``5-4``, ``1-1001``, three stage names for two IPUs, a
layer named twice and the Interleaved schedule at start: ``ringtrain render`` accepted jobs
whose every pod then exited 2 (issue 35, item 5). Each rule is a pure function here; the
worker's ``optiongen.check`` and the operator's spec check both call :func:`errors`, and
name the option their own way (``--trace-steps``, ``spec.trainer.trace.steps``).

This module imports nothing of ringtrain's but its errors: it is part of the contract.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ringtrain.errors import InvalidSpec

#: The longest trace window: the tracer's table stays a few MB.
MAX_TRACE_STEPS = 1000
#: The pipeline schedules the trainer runs (Graphcore's Interleaved is refused).
SCHEDULES = ("Grouped", "Sequential")
_STEPS = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def trace_error(text: str | None) -> str | None:
    """Why ``text`` is no trace window ``A-B`` (or ``A``), 1 <= A <= B, at most
    :data:`MAX_TRACE_STEPS` steps; None when it is one (or absent)."""
    if text is None:
        return None
    m = _STEPS.fullmatch(text)
    if not m:
        return f"{text!r}: expected A-B, e.g. 10-12"
    first, last = int(m[1]), int(m[2] or m[1])
    if first < 1 or last < first:
        return f"{text!r}: need 1 <= A <= B"
    if last - first + 1 > MAX_TRACE_STEPS:
        return f"{text!r}: at most {MAX_TRACE_STEPS} steps"
    return None


def trace_window(text: str | None) -> tuple[int, int] | None:
    """``"A-B"`` (or ``"A"``) → (A, B), steps counted from 1 as progress lines count them;
    :class:`InvalidSpec` naming ``--trace-steps`` when :func:`trace_error` refuses it."""
    if (why := trace_error(text)) is not None:
        raise InvalidSpec(f"--trace-steps {why}")
    if text is None:
        return None
    m = _STEPS.fullmatch(text)
    assert m is not None
    return int(m[1]), int(m[2] or m[1])


def stage_names(text: str | None) -> tuple[str, ...]:
    """``pipeline.stages`` as layer names ((): absent, or ``auto``)."""
    if not text or text.strip() == "auto":
        return ()
    return tuple(n.strip() for n in text.split(",") if n.strip())


def stages_error(text: str | None, ipus: int) -> str | None:
    """Why ``pipeline.stages`` cannot cut a model over ``ipus`` IPUs, whatever the model: the
    names begin stages 2, 3, …, so there are ``ipus - 1`` of them, each once. (Whether the
    model has those layers, in that order, is the worker's to check: it builds the model.)"""
    names = stage_names(text)
    if not names:
        return None
    if len(names) != ipus - 1:
        return (
            f"names {len(names)} layers, which makes {len(names) + 1} stages, but "
            f"ipusPerWorker is {ipus} (one stage per IPU)"
        )
    if len(set(names)) != len(names):
        return "name the layers in model order, each once"
    return None


def schedule_error(schedule: str | None, stages: str | None) -> str | None:
    """Why a pipelined job's schedule does not run (a schedule without stages is unused)."""
    if stages and schedule is not None and schedule not in SCHEDULES:
        return f"{schedule!r} is not implemented: {' and '.join(SCHEDULES)} run"
    return None


#: option name → why its value (with the others it depends on) is refused, or None
RULES: Mapping[str, Callable[[Mapping[str, Any]], str | None]] = {
    "trace_steps": lambda v: trace_error(v.get("trace_steps")),
    "pipeline_stages": lambda v: stages_error(
        v.get("pipeline_stages"), v.get("ipus_per_worker") or 1
    ),
    "pipeline_schedule": lambda v: schedule_error(
        v.get("pipeline_schedule"), v.get("pipeline_stages")
    ),
}


def errors(values: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(option name, why) for each value the rules refuse, in :data:`RULES` order."""
    for name, rule in RULES.items():
        if (why := rule(values)) is not None:
            yield name, why
