"""Every failure says why (issue 34): the worker's own words from its termination message, bounded,
in the Failed condition's message and its Event — for a data or spec error (exit 2), not only for
divergence; a plain-text message (a user's script, or the kubelet's log tail under
FallbackToLogsOnError) by its end; a JSON result is no reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
from operator_jobs import job
from test_status import cond, exited, pod, running, step

from ringtrain.errors import EXIT_PERMANENT
from ringtrain_operator import status as st
from ringtrain_operator.restarts import ERROR_CHARS

SAID = "InvalidSpec: --data /data/d.npz: not an .npz archive (File is not a zip file)"


def failed_job(failed):
    j = job(workers=2)
    prev = step(j, running(j), None).status
    return step(j, running(j, **{"mnist-worker-1": failed}), prev)


def test_a_data_error_fails_the_job_with_the_workers_own_words_in_condition_and_event():
    log = json.dumps({"event": "error", "error": SAID, "exit_code": EXIT_PERMANENT})
    d = failed_job(pod("mnist-worker-1", "Failed", exit_code=EXIT_PERMANENT, message=log))
    c = cond(d.status, st.FAILED)
    assert (d.status["state"], c["reason"]) == (st.FAILED, st.REASON_FAILED)
    assert c["message"] == (
        "pod mnist-worker-1 failed with exit code 2: permanent under restartPolicy ExitCode: "
        + SAID
    )
    assert [(e.type, e.reason, e.message) for e in d.events] == [
        ("Warning", st.REASON_FAILED, c["message"])
    ]


def test_the_workers_words_are_bounded():
    log = json.dumps({"event": "error", "error": SAID + "x" * 10_000, "exit_code": 2})
    d = failed_job(pod("mnist-worker-1", "Failed", exit_code=2, message=log))
    message = cond(d.status, st.FAILED)["message"]
    assert SAID in message and len(message) < ERROR_CHARS + 100


def test_a_plain_text_message_is_kept_by_its_end_on_one_line():
    text = "Traceback (most recent call last):\n" + "  x\n" * 300 + "ValueError: bad shape\n"
    d = failed_job(pod("mnist-worker-1", "Failed", exit_code=1, message=text))
    message = cond(d.status, st.FAILED)["message"]
    assert message.endswith(" | ValueError: bad shape") and "\n" not in message
    assert ": …" in message and len(message) < ERROR_CHARS + 100


@pytest.mark.parametrize("message", [None, "", json.dumps({"steps": 3, "loss": 0.1})])
def test_without_words_the_message_is_the_exit_alone(message):
    d = failed_job(pod("mnist-worker-1", "Failed", exit_code=2, message=message))
    assert cond(d.status, st.FAILED)["message"] == (
        "pod mnist-worker-1 failed with exit code 2: permanent under restartPolicy ExitCode"
    )


def test_backoff_limit_exceeded_names_the_last_failures_words():
    j = job(workers=2, run_policy={"backoffLimit": 0})
    prev = step(j, running(j), None).status
    said = "PeerTimeout: step 7 rank 1: peer worker-0 sent nothing for 30 s"
    log = json.dumps({"event": "error", "error": said, "exit_code": 138})
    crashed = dataclasses.replace(exited("mnist-worker-1", 138), termination_message=log)
    d = step(j, running(j, **{"mnist-worker-1": crashed}), prev)
    c = cond(d.status, st.FAILED)
    assert c["reason"] == st.REASON_BACKOFF and c["message"].endswith(": " + said)


def test_a_permanent_exit_seen_after_its_restart_still_says_why():
    """The kubelet restarted the container (OnFailure) before the operator looked: the exit
    and the worker's words are in ``lastState.terminated``, not in ``state``."""
    from ringtrain_operator import manifests
    from ringtrain_operator.observe import ObservedPod

    log = json.dumps({"event": "error", "error": SAID, "exit_code": EXIT_PERMANENT})
    obj = {
        "metadata": {
            "name": "mnist-worker-1",
            "labels": {manifests.LABEL_ROLE: "worker", manifests.LABEL_INDEX: "1"},
        },
        "spec": {"restartPolicy": "OnFailure", "containers": [{"name": manifests.MAIN_CONTAINER}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": manifests.MAIN_CONTAINER,
                    "restartCount": 1,
                    "state": {"running": {}},
                    "lastState": {"terminated": {"exitCode": EXIT_PERMANENT, "message": log}},
                }
            ],
        },
    }
    seen = ObservedPod.from_pod(obj)
    assert seen is not None and seen.termination_message is None
    d = failed_job(seen)
    c = cond(d.status, st.FAILED)
    assert c["message"].endswith(": " + SAID), c["message"]
