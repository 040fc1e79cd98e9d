"""A replica's process seen as the Pod the operator's fold observes: phase, exit codes, result.

Split out of :mod:`ringtrain_localrun.supervisor` because translating a process into an
``ObservedPod`` (Kubernetes' exit-code and restart semantics) is its own concept, independent of
how the runner starts and stops processes; the supervisor re-exports these names.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
from pathlib import Path

from ringtrain import events
from ringtrain_operator import observe

from .plan import Replica


def restarts_in_place(replica: Replica, returncode: int) -> bool:
    """Whether the kubelet would start this exited container again in its Pod."""
    return replica.restart_policy == "Always" or (
        replica.restart_policy == "OnFailure" and returncode != 0
    )


def observed_pod(
    replica: Replica,
    proc: subprocess.Popen,
    restarts: int = 0,
    last: subprocess.Popen | None = None,
) -> observe.ObservedPod:
    """A replica's process as the Pod the operator's fold would observe.

    It is Running until it exits; then, if its restartPolicy restarts it in place, still Running
    with the exit as ``state.terminated`` (``restarting``), else Succeeded (exit 0) or Failed.
    Exit codes are what Kubernetes reports (a signal n becomes 128 + n, named like the kubelet's
    reason), an exit's termination message the kubelet's (:func:`termination_message`);
    ``restarts`` and ``last`` (the previous process) are restartCount and lastState.
    """
    code = proc.poll()
    last_code = last.returncode if last is not None else None
    pod = observe.ObservedPod(
        name=replica.name,
        role=replica.role,
        index=replica.index,
        phase="Running",
        ready=True,
        restarts=restarts,
        last_exit_code=None if last_code is None else exit_status(last_code),
        last_exit_reason=_reason(last_code),
    )
    if code is None:
        return pod
    return dataclasses.replace(
        pod,
        termination_message=termination_message(replica, code),
        ready=False,
        exit_code=exit_status(code),
        exit_reason=_reason(code),
        restarting=restarts_in_place(replica, code),
        phase="Running"
        if restarts_in_place(replica, code)
        else "Succeeded"
        if code == 0
        else "Failed",
    )


#: Bytes of a termination message the kubelet keeps (its own limit per container).
TERMINATION_MESSAGE_BYTES = 4096
#: FallbackToLogsOnError's log tail: the kubelet's 80 lines or 2048 bytes, the fewer.
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048


def termination_message(replica: Replica, returncode: int) -> str | None:
    """What the kubelet would put in ``state.terminated.message``: the termination log (its
    first 4096 bytes), else under terminationMessagePolicy FallbackToLogsOnError and a failure,
    the tail of the replica's log; None without either. The fold takes the worker's own words
    for a failure from it (issue 34)."""
    text = _head(replica.termination_log, TERMINATION_MESSAGE_BYTES)
    if text or returncode == 0 or replica.termination_message_policy != "FallbackToLogsOnError":
        return text or None
    tail = _tail(replica.log, FALLBACK_BYTES)
    return "\n".join(tail.splitlines()[-FALLBACK_LINES:]) or None


def _head(path: str | None, n: int) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            return f.read(n).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: str | None, n: int) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - n))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _reason(returncode: int | None) -> str | None:
    return signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None


def exit_status(returncode: int) -> int:
    """A container's exit code as Kubernetes reports it: a signal n becomes 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def read_result(r: Replica) -> events.Final | None:
    """A replica's final event from its termination log (None: none, or an error record)."""
    if not r.termination_log:
        return None
    try:
        doc = json.loads(Path(r.termination_log).read_text())
    except (OSError, ValueError):
        return None
    event = events.parse(doc)
    return event if isinstance(event, events.Final) else None
