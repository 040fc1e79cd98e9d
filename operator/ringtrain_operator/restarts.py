"""How a member's failure is judged: permanent, a lost pod to recreate, or a restart in place.

Pure helpers of :mod:`.status`. Under every restartPolicy but Never the pod runs with the Pod
restartPolicy OnFailure (Always for Always), so its kubelet restarts a failed container in place
before the operator sees it; what the operator reads is the container's current termination or,
once restarted, ``lastState.terminated`` — both carry the exit code the policies are about.
"""

from __future__ import annotations

import json

from ringtrain import errors

from .job import ReplicaSpec
from .observe import ObservedPod

#: Exit codes the ExitCode policy treats as permanent (the user must fix something).
PERMANENT_EXIT_CODES = range(1, 128)


def exit_code(p: ObservedPod) -> int | None:
    """The main container's exit code: its current termination, else its previous run's."""
    return p.exit_code if p.exit_code is not None else p.last_exit_code


#: The kubelet's reason for a container the kernel killed at its cgroup's memory limit.
OOM_KILLED = "OOMKilled"


def describe_exit(p: ObservedPod) -> str:
    """``exit code 137 (Error)``, or why there is none (``no exit code (Evicted)``). A container
    killed for memory says so with its limit (issue 20): ``exit code 137 (OOMKilled: out of
    memory at its limit of 1374Mi)``, so the job's Event tells what to raise."""
    code = exit_code(p)
    reason = p.exit_reason if p.exit_code is not None else p.last_exit_reason or p.exit_reason
    if code is None:
        return f"no exit code ({reason or p.phase})"
    if reason == OOM_KILLED:
        where = f"at its limit of {p.memory_limit}" if p.memory_limit else "(no memory limit)"
        reason = f"{OOM_KILLED}: out of memory {where}"
    return f"exit code {code}" + (f" ({reason})" if reason else "")


#: characters of a worker's error carried into a condition's message
ERROR_CHARS = 500


def failure_message(p: ObservedPod) -> str:
    """The termination message of the run that failed: the current one, else (the container
    already restarted in place) the previous run's."""
    return (p.termination_message or p.last_termination_message or "").strip()


def last_error(p: ObservedPod) -> str:
    """The worker's own words for its failure, from its termination log (``{"event":
    "error", "error": ...}``), or ""; bounded, the log is the container's to write."""
    try:
        doc = json.loads(failure_message(p))
    except ValueError:
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    return error[:ERROR_CHARS] if isinstance(error, str) else ""


def judge(replica: ReplicaSpec, p: ObservedPod) -> str | None:
    """None (carry on: running, or restarting in place), "permanent" (fail the job) or
    "replace" (delete this pod and create it again)."""
    if replica.restart_policy == "ExitCode" and exit_code(p) in PERMANENT_EXIT_CODES:
        # The kubelet restarts any non-zero exit under OnFailure, so the code is read from
        # lastState too: a permanent exit fails the job even once its container runs again.
        return "permanent"
    if p.phase != "Failed":
        return None
    if replica.restart_policy == "Never":
        return "permanent"
    # The pod itself is lost (evicted, its node lost: no exit code), or it was created with the
    # Pod restartPolicy Never by an older operator: only a new pod can run the member again.
    return "replace"


def likely_causes(pods: list[ObservedPod]) -> list[ObservedPod]:
    """Pods restarted in place, the likely cause first: its last exit was not the retryable
    138 that peers exit with when a ring member vanishes."""
    return sorted(
        (p for p in pods if p.restarts), key=lambda p: p.last_exit_code == errors.EXIT_RETRYABLE
    )
