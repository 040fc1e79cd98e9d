"""Bounds on what a worker's words may make of a TrainingJob's status (issue 35, item 5).

The status is an API object kept in etcd (at most 1.5 MiB for the whole object, spec included),
and its progress and evaluation are copied from a process the tenant wrote: its ``/status`` reply
(up to 1 MiB) and its termination message. A hostile ``/status`` once made a 1.3 MB
``status.progress.ipuMemory`` out of one 1 MiB reply (a report with tens of thousands of
"kinds"). So every value copied is bounded where it is read (:func:`number`, :func:`text`,
:func:`ipu_memory`; ``observe.read_progress`` applies them), and the whole status once more
before it is written (:func:`bounded`): whatever a worker answers, the status stays under
:data:`STATUS_MAX_BYTES`. What is cut is said: ``truncated`` lists the fields left out or
shortened for their size (a list that is shortened ends with ``"… N more"``).

Pure functions of plain values: no I/O, nothing of the operator imported.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

#: The most the whole status may take as compact JSON: the operator's own part (state,
#: conditions, replica counts) is a few KiB, and 64 KiB leaves etcd's 1.5 MiB to the spec.
STATUS_MAX_BYTES = 64 << 10
#: The longest string copied: a path is at most PATH_MAX.
STRING_MAX = 4096
#: Characters of a condition's message (an InvalidSpec quoting a spec value, a worker's error).
MESSAGE_MAX = 4096
#: Names in ``waitingFor``: the ring's missing members, each a DNS label.
WAITING_MAX = 64
NAME_MAX = 63
#: Entries of ``ipuMemory``: a real report has 6 kinds, capacity, total and 1 host kind.
MEMORY_ENTRIES_MAX = 24
#: A memory kind's name as the trainer writes it (``optimizer_state``).
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: The largest integer a status field carries: JSON's exact range, inside the API's int64.
INT_MAX = 2**53
#: The key that lists what was cut.
TRUNCATED = "truncated"
#: The status parts a worker's words fill (the rest is the operator's own).
WORKER_PARTS = ("progress", "evaluation")


def number(v: Any) -> int | float | None:
    """A number the status can carry, else None: not a bool, finite, and an int within ±2⁵³
    (a reply may say ``"step": 1e40`` as an int the API server refuses, failing every status
    write of the job); a float rounded to 6 places."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int):
        return v if abs(v) <= INT_MAX else None
    return round(v, 6) if math.isfinite(v) else None


def text(v: Any, limit: int = STRING_MAX) -> str | None:
    """A string of at most ``limit`` characters, else None (a cut path would name another)."""
    return v if isinstance(v, str) and len(v) <= limit else None


def names(v: Any) -> tuple[list[str], bool]:
    """``waiting_for`` → at most :data:`WAITING_MAX` names of a DNS label's length, the rest
    counted in a last ``"… N more"``; and whether anything was cut."""
    if not isinstance(v, list):
        return [], False
    out = [w[:NAME_MAX] for w in v if isinstance(w, str)]
    cut = any(len(w) > NAME_MAX for w in v if isinstance(w, str))
    if len(out) > WAITING_MAX:
        return [*out[:WAITING_MAX], f"… {len(out) - WAITING_MAX} more"], True
    return out, cut


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w.title() for w in rest)


def ipu_memory(doc: Any) -> tuple[dict, bool]:
    """``/status``'s ``ipu_memory`` → ``status.progress.ipuMemory``: per IPU, bytes by kind
    (``weightsBytes`` … ``optimizerStateBytes``), ``totalBytes``, ``capacityBytes`` and
    ``hostOptimizerStateBytes``; and whether entries were cut. The per-layer table stays in
    ``/status`` and ``--report``. Kinds are named as the trainer names them (lower-case, at most
    32 characters) and at most :data:`MEMORY_ENTRIES_MAX` are kept. ({}, False) when ``doc``
    is not a memory report."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("kinds"), Mapping):
        return {}, False
    host = doc.get("host")
    host = host if isinstance(host, Mapping) else {}
    pairs = [
        ("capacity", doc.get("capacity")),
        ("total", doc.get("total")),
        *doc["kinds"].items(),
        *((f"host_{k}", v) for k, v in host.items()),
    ]
    out: dict[str, int] = {}
    cut = False
    for k, v in pairs:
        if not isinstance(v, int) or number(v) is None:
            continue  # malformed, not too large: left out as before
        if not isinstance(k, str) or not _KIND.fullmatch(k) or len(out) >= MEMORY_ENTRIES_MAX:
            cut = True
            continue
        out[f"{_camel(k)}Bytes"] = v
    return out, cut


def size(doc: Any) -> int:
    """Bytes of ``doc`` as compact JSON, as the API server stores it (about)."""
    return len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())


def _numbers_only(part: Mapping[str, Any]) -> dict:
    """A worker part with only its numbers, and every other field named in ``truncated``."""
    keep = {k: v for k, v in part.items() if k != TRUNCATED and number(v) is not None}
    cut = sorted(k for k in part if k != TRUNCATED and k not in keep)
    return {**keep, TRUNCATED: cut} if cut else keep


def bounded(status: Mapping[str, Any], max_bytes: int = STATUS_MAX_BYTES) -> dict:
    """``status`` within ``max_bytes``: conditions' messages cut to :data:`MESSAGE_MAX`; if it is
    still larger, the worker parts keep only their numbers (the rest named in ``truncated``),
    and last, they go. The fields read from workers are bounded one by one where they are read,
    so this is the backstop for a field added later without its bound."""
    out = dict(status)
    conds = out.get("conditions")
    if isinstance(conds, list) and any(_long_message(c) for c in conds):
        out["conditions"] = [
            {**c, "message": c["message"][: MESSAGE_MAX - 1] + "…"} if _long_message(c) else c
            for c in conds
        ]
    if size(out) <= max_bytes:
        return out
    for key in WORKER_PARTS:
        if isinstance(out.get(key), Mapping):
            out[key] = _numbers_only(out[key])
    for key in WORKER_PARTS:
        if size(out) <= max_bytes:
            break
        out.pop(key, None)
    return out


def _long_message(c: Any) -> bool:
    return (
        isinstance(c, Mapping)
        and isinstance(c.get("message"), str)
        and (len(c["message"]) > MESSAGE_MAX)
    )
