"""The policy-scanner exceptions the operator writes on the pods it renders, each with its reason.

checkov (tests/chart/test_checkov.py) reads ``checkov.io/skip<N>: <check>=<reason>`` annotations
as recorded exceptions. Issue 35 asks for zero failures without one: the MPI launcher's missing
probes were allowed by the test alone, so they are written where the scanner (and anyone reading
the pod) sees them, with the reason (decision 0210).

Pure functions of plain values.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The annotation prefix checkov reads (checkov.kubernetes.kubernetes_utils).
PREFIX = "checkov.io/skip"

#: Why an MPI launcher has no probes. It is mpirun (the operator's wrapper, or a template's own
#: command) and serves nothing: no port to ask, no Service that reads its readiness. Alive means
#: its process runs, which its container's own exit already says; a hang of mpirun is a hang of
#: the ranks, which no launcher-side probe can tell from a slow step (a compile, an
#: evaluation) without restarting a healthy job. The operator judges it by its exit code.
LAUNCHER = {
    "CKV_K8S_8": "the MPI launcher runs mpirun and serves nothing to probe; a liveness probe "
    "could only restate that its process runs, which its exit says; the operator judges it by "
    "its exit code (decision 0210)",
    "CKV_K8S_9": "the MPI launcher serves nothing and no Service reads its readiness; the "
    "operator judges it by its exit code (decision 0210)",
}


def with_skips(annotations: Mapping[str, str], skips: Mapping[str, str]) -> dict[str, str]:
    """``annotations`` plus one ``checkov.io/skip<N>`` per check of ``skips`` not skipped yet,
    at the lowest free N: a template's own skips (the stock MPI example carries two) stay as
    they are and are never overwritten."""
    out = dict(annotations)
    taken = {k for k in out if k.startswith(PREFIX)}
    skipped = {str(v).split("=", 1)[0].strip() for k, v in out.items() if k in taken}
    n = 1
    for check, reason in skips.items():
        if check in skipped:
            continue
        while f"{PREFIX}{n}" in taken:
            n += 1
        out[f"{PREFIX}{n}"] = f"{check}={reason}"
        taken.add(f"{PREFIX}{n}")
    return out
