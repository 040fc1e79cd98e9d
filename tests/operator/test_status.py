"""The lifecycle fold, path by path: each test feeds observed pods and checks status and actions."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from operator_jobs import job

from ringtrain_operator import lifecycle
from ringtrain_operator import status as st
from ringtrain_operator.lifecycle import derive_status
from ringtrain_operator.observe import ObservedPod

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def pod(
    name: str,
    phase: str = "Running",
    *,
    ready: bool = True,
    restarts: int = 0,
    exit_code: int | None = None,
    deleting: bool = False,
    message: str | None = None,
    live: dict | None = None,
    restarting: bool = False,
    last_exit_code: int | None = None,
) -> ObservedPod:
    _, role, index = name.rsplit("-", 2)
    return ObservedPod(
        name=name,
        role=role,
        index=int(index),
        phase=phase,
        ready=ready,
        restarts=restarts,
        exit_code=exit_code,
        deleting=deleting,
        termination_message=message,
        pod_ip="10.1.0.5",
        live_status=live,
        restarting=restarting,
        last_exit_code=last_exit_code,
    )


def exited(name: str, code: int, restarts: int = 0) -> ObservedPod:
    """A container that exited with ``code``; its kubelet will start it again in its pod."""
    return pod(name, ready=False, restarts=restarts, exit_code=code, restarting=True)


def restarted(name: str, code: int, restarts: int = 1) -> ObservedPod:
    """A container the kubelet restarted in place after it exited with ``code``."""
    return pod(name, restarts=restarts, last_exit_code=code)


def running(j, **overrides) -> list[ObservedPod]:
    return [
        overrides.get(j.pod_name(r.role, i)) or pod(j.pod_name(r.role, i)) for r, i in j.members()
    ]


def cond(status: dict, ctype: str) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == ctype), None)


def reasons(d: st.Decision) -> list[str]:
    return [e.reason for e in d.events]


def step(j, pods, previous, at=T0):
    return derive_status(j, pods, at, previous)


def test_new_job_creates_every_pod_and_the_created_condition():
    j = job(workers=2, chief=1)
    d = step(j, [], None)
    assert d.create == ("mnist-chief-0", "mnist-worker-0", "mnist-worker-1")
    assert d.delete == ()
    assert d.status["state"] == st.CREATED
    assert cond(d.status, st.CREATED)["status"] == "True"
    assert d.status["startTime"] == "2024-05-01T12:00:00Z"
    assert d.status["workers"] == "0/3"
    assert reasons(d) == [st.REASON_CREATED]


def test_created_becomes_running_once_all_pods_run_and_then_stays_quiet():
    j = job()
    d1 = step(j, [], None)
    d2 = step(j, [pod("mnist-worker-0", "Pending", ready=False), pod("mnist-worker-1")], d1.status)
    assert d2.status["state"] == st.CREATED and d2.create == () and d2.events == ()
    d3 = step(j, running(j), d2.status, T0 + timedelta(seconds=5))
    assert d3.status["state"] == st.RUNNING
    assert reasons(d3) == [st.REASON_RUNNING]
    assert d3.status["workers"] == "2/2"
    assert d3.status["replicaStatuses"]["Worker"] == {
        "active": 2,
        "succeeded": 0,
        "failed": 0,
        "restarts": 0,
    }
    d4 = step(j, running(j), d3.status, T0 + timedelta(seconds=10))
    assert d4.events == () and d4.status == d3.status  # steady state: no patch, no event


def test_missing_pod_is_recreated_without_duplicates():
    j = job(workers=3)
    d = step(j, [pod("mnist-worker-0"), pod("mnist-worker-2")], {"state": st.RUNNING})
    assert d.create == ("mnist-worker-1",)


def test_chief_success_succeeds_the_job_and_cleans_running_pods():
    j = job(workers=2, chief=1, ps=1)
    prev = step(j, running(j), step(j, [], None).status).status
    pods = running(j, **{"mnist-chief-0": pod("mnist-chief-0", "Succeeded", exit_code=0)})
    d = step(j, pods, prev, T0 + timedelta(minutes=3))
    assert d.status["state"] == st.SUCCEEDED
    assert d.status["completionTime"] == "2024-05-01T12:03:00Z"
    assert cond(d.status, st.SUCCEEDED)["status"] == "True"
    assert cond(d.status, st.RUNNING)["status"] == "False"
    assert set(d.delete) == {"mnist-worker-0", "mnist-worker-1", "mnist-ps-0"}  # Running policy
    assert reasons(d) == [st.REASON_SUCCEEDED]


def test_worker0_decides_success_without_a_chief_but_not_worker1():
    j = job(workers=2)
    prev = step(j, running(j), None).status
    d = step(j, running(j, **{"mnist-worker-1": pod("mnist-worker-1", "Succeeded")}), prev)
    assert d.status["state"] != st.SUCCEEDED
    d = step(j, running(j, **{"mnist-worker-0": pod("mnist-worker-0", "Succeeded")}), prev)
    assert d.status["state"] == st.SUCCEEDED


def test_all_workers_success_policy_waits_for_every_worker():
    j = job(workers=2, run_policy={"successPolicy": "AllWorkers"})
    prev = step(j, running(j), None).status
    one = running(j, **{"mnist-worker-0": pod("mnist-worker-0", "Succeeded")})
    assert step(j, one, prev).status["state"] != st.SUCCEEDED
    both = [pod("mnist-worker-0", "Succeeded"), pod("mnist-worker-1", "Succeeded")]
    assert step(j, both, prev).status["state"] == st.SUCCEEDED


@pytest.mark.parametrize("code", [1, 2, 127])
def test_exit_code_policy_fails_permanently_on_1_to_127(code):
    j = job(workers=2)
    prev = step(j, running(j), None).status
    d = step(
        j, running(j, **{"mnist-worker-1": pod("mnist-worker-1", "Failed", exit_code=code)}), prev
    )
    assert d.status["state"] == st.FAILED
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_FAILED
    assert f"exit code {code}" in cond(d.status, st.FAILED)["message"]
    assert d.delete == ("mnist-worker-0",)  # cleanPodPolicy Running: the failed pod stays
    assert d.create == ()


@pytest.mark.parametrize("code", [128, 137, 138, 143, None])
def test_a_lost_pod_alone_is_replaced_whatever_its_retryable_code(code):
    """A pod in phase Failed (evicted, node lost, or an older operator's restartPolicy Never
    pod) cannot run again: it alone is recreated, its peers restart in their own pods."""
    j = job(workers=3)
    prev = step(j, running(j), None).status
    d = step(
        j, running(j, **{"mnist-worker-2": pod("mnist-worker-2", "Failed", exit_code=code)}), prev
    )
    assert d.status["state"] == st.RESTARTING
    assert d.delete == ("mnist-worker-2",)
    assert d.create == ()
    assert d.status["restarts"] == 1 and d.status["gangRestarts"] == 1
    assert reasons(d) == [st.REASON_RESTARTING]
    assert cond(d.status, st.RESTARTING)["status"] == "True"
    assert "pod mnist-worker-2 failed with" in d.events[0].message
    assert "recreating it, the other pods restart in place (restart 1 of 6)" in d.events[0].message


def test_a_replaced_pod_is_recreated_once_gone_and_counted_once():
    j = job(workers=2)
    prev = step(j, running(j), None).status
    failed = running(j, **{"mnist-worker-1": pod("mnist-worker-1", "Failed", exit_code=None)})
    d1 = step(j, failed, prev)
    assert d1.delete == ("mnist-worker-1",)
    # Deletion in progress: nothing created, nothing counted again, the peer is left alone.
    terminating = [pod("mnist-worker-0"), pod("mnist-worker-1", "Failed", deleting=True)]
    d2 = step(j, terminating, d1.status)
    assert d2.create == () and d2.delete == () and d2.events == ()
    assert d2.status["restarts"] == 1 and d2.status["state"] == st.RESTARTING
    d3 = step(j, [pod("mnist-worker-0")], d2.status)
    assert d3.create == ("mnist-worker-1",) and d3.delete == ()
    assert d3.status["restarts"] == 1 and d3.status["state"] == st.RESTARTING
    d4 = step(j, running(j), d3.status)
    assert d4.status["state"] == st.RUNNING
    assert cond(d4.status, st.RESTARTING)["status"] == "False"
    assert d4.status["restarts"] == 1 and reasons(d4) == [st.REASON_RUNNING]


def test_a_worker_restarts_in_place_with_its_peers_and_nothing_is_deleted():
    """The default ExitCode policy: a SIGKILLed worker is restarted by its kubelet, its peer
    leaves the ring (138) and is restarted too; every restart counts, no pod is touched."""
    j = job(workers=2)
    prev = step(j, running(j), None).status
    d1 = step(j, running(j, **{"mnist-worker-1": exited("mnist-worker-1", 137)}), prev)
    assert (d1.status["state"], d1.status["restarts"]) == (st.RESTARTING, 1)
    assert d1.delete == () and d1.create == () and reasons(d1) == [st.REASON_RESTARTING]
    assert d1.events[0].message == (
        "pod mnist-worker-1 failed with exit code 137: restarting "
        "in place, its peers rejoin the ring (restart 1 of 6)"
    )
    assert cond(d1.status, st.RESTARTING)["status"] == "True"
    assert cond(d1.status, st.RUNNING)["status"] == "False"
    # Seen again after the kubelet restarted it: the same restart, not a new one; all run.
    d2 = step(j, [pod("mnist-worker-0"), restarted("mnist-worker-1", 137)], d1.status)
    assert d2.status["restarts"] == 1 and reasons(d2) == [st.REASON_RUNNING]
    d3 = step(j, [exited("mnist-worker-0", 138), restarted("mnist-worker-1", 137)], d2.status)
    assert (d3.status["state"], d3.status["restarts"]) == (st.RESTARTING, 2)
    assert "pod mnist-worker-0 failed with exit code 138: restarting in place" in (
        d3.events[0].message
    )
    both = [restarted("mnist-worker-0", 138), restarted("mnist-worker-1", 137)]
    d4 = step(j, both, d3.status)
    assert (d4.status["state"], d4.status["restarts"]) == (st.RUNNING, 2)
    assert reasons(d4) == [st.REASON_RUNNING] and d4.delete == () and d4.create == ()
    assert cond(d4.status, st.RESTARTING)["status"] == "False"
    assert step(j, both, d4.status).events == ()
    assert d4.status["replicaStatuses"]["Worker"]["restarts"] == 2
    assert "gangRestarts" not in d4.status


def test_a_restart_in_place_seen_only_afterwards_is_still_shown_and_names_the_cause():
    """The kubelet may restart a container before the operator looks: restartCount tells."""
    j = job(workers=3)
    prev = step(j, running(j), None).status
    d = step(
        j,
        [
            restarted("mnist-worker-0", 138),
            restarted("mnist-worker-1", 137),
            restarted("mnist-worker-2", 138),
        ],
        prev,
    )
    assert (d.status["state"], d.status["restarts"]) == (st.RESTARTING, 3)
    assert [e.message for e in d.events] == [
        "pod mnist-worker-1 failed with exit code 137: restarting in place, its peers rejoin "
        "the ring (restart 3 of 6)"
    ]


@pytest.mark.parametrize("code", [1, 2, 127])
@pytest.mark.parametrize("seen", ["exited", "restarted"])
def test_a_permanent_code_fails_the_job_even_after_the_kubelet_restarted_it(code, seen):
    """Under ExitCode the pod runs with restartPolicy OnFailure, so the kubelet restarts a
    permanent exit too: the code in state or lastState fails the job, with cleanPodPolicy."""
    j = job(workers=2)
    prev = step(j, running(j), None).status
    failed = (
        exited("mnist-worker-1", code) if seen == "exited" else restarted("mnist-worker-1", code)
    )
    d = step(j, running(j, **{"mnist-worker-1": failed}), prev)
    assert d.status["state"] == st.FAILED
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_FAILED
    assert cond(d.status, st.FAILED)["message"] == (
        f"pod mnist-worker-1 failed with exit code {code}: permanent under restartPolicy ExitCode"
    )
    assert reasons(d) == [st.REASON_FAILED]
    # cleanPodPolicy Running: both pods are phase Running (one restarting), both go.
    assert set(d.delete) == {"mnist-worker-0", "mnist-worker-1"} and d.create == ()
    assert d.status["restarts"] == (0 if seen == "exited" else 1)  # only restarts that happened
    # It stays Failed, and keeps cleaning, after the kubelet restarted it.
    again = step(j, running(j, **{"mnist-worker-1": restarted("mnist-worker-1", code)}), d.status)
    assert again.status["state"] == st.FAILED and again.events == ()
    assert set(again.delete) == {"mnist-worker-0", "mnist-worker-1"}


def test_a_permanent_failure_with_clean_pod_policy_none_deletes_nothing():
    j = job(workers=2, run_policy={"cleanPodPolicy": "None"})
    d = step(
        j,
        running(j, **{"mnist-worker-1": exited("mnist-worker-1", 2)}),
        step(j, running(j), None).status,
    )
    assert d.status["state"] == st.FAILED and d.delete == ()
    # The kubelet goes on restarting what None keeps: the finished job's count stays put.
    later = step(
        j,
        [restarted("mnist-worker-0", 138, restarts=3), exited("mnist-worker-1", 2, restarts=4)],
        d.status,
    )
    assert later.status["state"] == st.FAILED and later.status["restarts"] == 0
    assert later.events == () and later.delete == ()


@pytest.mark.parametrize("policy", ["OnFailure", "Always"])
def test_on_failure_and_always_restart_in_place_whatever_the_code(policy):
    j = job(workers=2, policy=policy)
    d = step(
        j,
        running(j, **{"mnist-worker-1": restarted("mnist-worker-1", 2)}),
        step(j, running(j), None).status,
    )
    assert (d.status["state"], d.status["restarts"]) == (st.RESTARTING, 1)
    assert d.delete == ()


def test_backoff_limit_counts_every_restart_in_place():
    j = job(workers=2, run_policy={"backoffLimit": 2})
    prev = step(j, running(j), None).status
    d1 = step(j, [pod("mnist-worker-0"), exited("mnist-worker-1", 137)], prev)
    assert (d1.status["state"], d1.status["restarts"]) == (st.RESTARTING, 1)
    d2 = step(j, [restarted("mnist-worker-0", 138), restarted("mnist-worker-1", 137)], d1.status)
    assert (d2.status["state"], d2.status["restarts"]) == (st.RESTARTING, 2)
    d3 = step(j, [restarted("mnist-worker-0", 138), restarted("mnist-worker-1", 137)], d2.status)
    assert d3.status["state"] == st.RUNNING
    # A third restart would exceed backoffLimit=2: Failed, and it is not counted.
    d4 = step(
        j, [restarted("mnist-worker-0", 138), exited("mnist-worker-1", 137, restarts=1)], d3.status
    )
    assert d4.status["state"] == st.FAILED
    assert cond(d4.status, st.FAILED)["reason"] == st.REASON_BACKOFF
    assert cond(d4.status, st.FAILED)["message"] == (
        "pod mnist-worker-1 failed with exit code 137 and 2 restarts reached backoffLimit=2"
    )
    assert d4.status["restarts"] == 2
    assert set(d4.delete) == {"mnist-worker-0", "mnist-worker-1"}


def test_backoff_limit_zero_fails_on_the_first_restart_in_place_without_counting_it():
    j = job(workers=2, run_policy={"backoffLimit": 0})
    d = step(
        j,
        running(j, **{"mnist-worker-1": exited("mnist-worker-1", 137)}),
        step(j, running(j), None).status,
    )
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_BACKOFF
    assert d.status["restarts"] == 0


def test_backoff_limit_counts_gang_restarts():
    j = job(workers=2, run_policy={"backoffLimit": 1})
    status = step(j, running(j), None).status
    failed = running(j, **{"mnist-worker-0": pod("mnist-worker-0", "Failed", exit_code=138)})
    d1 = step(j, failed, status)
    assert d1.status["state"] == st.RESTARTING
    d2 = step(j, failed, step(j, running(j), step(j, [], d1.status).status).status)
    assert d2.status["state"] == st.FAILED
    assert cond(d2.status, st.FAILED)["reason"] == st.REASON_BACKOFF
    assert set(d2.delete) == {"mnist-worker-1"}


def test_backoff_limit_zero_fails_on_the_first_retryable_exit():
    j = job(workers=2, run_policy={"backoffLimit": 0})
    d = step(
        j,
        running(j, **{"mnist-worker-0": pod("mnist-worker-0", "Failed", exit_code=143)}),
        step(j, running(j), None).status,
    )
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_BACKOFF


def test_backoff_limit_counts_container_restarts_under_on_failure():
    j = job(workers=2, policy="OnFailure", run_policy={"backoffLimit": 2})
    prev = step(j, running(j), None).status
    d = step(j, running(j, **{"mnist-worker-1": pod("mnist-worker-1", restarts=2)}), prev)
    assert d.status["state"] == st.RESTARTING and d.status["restarts"] == 2
    assert reasons(d) == [st.REASON_RESTARTING]
    d = step(j, running(j, **{"mnist-worker-1": pod("mnist-worker-1", restarts=2)}), d.status)
    assert d.status["state"] == st.RUNNING and d.status["restarts"] == 2
    d = step(j, running(j, **{"mnist-worker-1": pod("mnist-worker-1", restarts=3)}), prev)
    assert d.status["state"] == st.FAILED
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_BACKOFF
    assert set(d.delete) == {"mnist-worker-0", "mnist-worker-1"}


def test_container_restarts_of_a_replaced_pod_still_count():
    j = job(workers=2, policy="OnFailure", run_policy={"backoffLimit": 3})
    prev = step(j, running(j), None).status
    evicted = running(
        j,
        **{
            "mnist-worker-0": pod("mnist-worker-0", restarts=1),
            "mnist-worker-1": pod("mnist-worker-1", "Failed", restarts=1),
        },
    )
    d1 = step(j, evicted, prev)
    assert d1.status["state"] == st.RESTARTING and d1.status["restarts"] == 3
    assert d1.delete == ("mnist-worker-1",)
    d2 = step(j, [pod("mnist-worker-0", restarts=1)], d1.status)
    assert d2.status["restarts"] == 3 and d2.create == ("mnist-worker-1",)
    d3 = step(
        j,
        running(
            j,
            **{
                "mnist-worker-0": pod("mnist-worker-0", restarts=1),
                "mnist-worker-1": pod("mnist-worker-1", restarts=1),
            },
        ),
        d2.status,
    )
    assert d3.status["restarts"] == 4
    assert cond(d3.status, st.FAILED)["reason"] == st.REASON_BACKOFF


def test_never_policy_fails_on_any_failure_even_a_retryable_code():
    j = job(workers=2, policy="Never")
    d = step(
        j,
        running(j, **{"mnist-worker-0": pod("mnist-worker-0", "Failed", exit_code=138)}),
        step(j, running(j), None).status,
    )
    assert d.status["state"] == st.FAILED
    assert cond(d.status, st.FAILED)["reason"] == st.REASON_FAILED


def test_active_deadline_fails_the_job_and_applies_clean_pod_policy_all():
    j = job(workers=2, run_policy={"activeDeadlineSeconds": 60, "cleanPodPolicy": "All"})
    d0 = step(j, [], None)
    d1 = step(j, running(j), d0.status, T0 + timedelta(seconds=30))
    assert d1.status["state"] == st.RUNNING
    assert d1.requeue_after_s == pytest.approx(30)
    d2 = step(j, running(j), d1.status, T0 + timedelta(seconds=60))
    assert d2.status["state"] == st.FAILED
    assert cond(d2.status, st.FAILED)["reason"] == st.REASON_DEADLINE
    assert set(d2.delete) == {"mnist-worker-0", "mnist-worker-1"}
    assert reasons(d2) == [st.REASON_DEADLINE]


def test_clean_pod_policy_none_keeps_every_pod():
    j = job(workers=2, run_policy={"activeDeadlineSeconds": 1, "cleanPodPolicy": "None"})
    d = step(j, running(j), step(j, [], None).status, T0 + timedelta(seconds=2))
    assert d.status["state"] == st.FAILED and d.delete == ()


def test_clean_pod_policy_is_reapplied_after_the_job_finished():
    j = job(workers=2)
    done = step(
        j,
        [pod("mnist-worker-0", "Succeeded"), pod("mnist-worker-1")],
        step(j, running(j), None).status,
    )
    # The operator died before deleting; a later reconcile still cleans up, without new events.
    d = step(j, [pod("mnist-worker-0", "Succeeded"), pod("mnist-worker-1")], done.status)
    assert d.delete == ("mnist-worker-1",) and d.events == () and d.create == ()
    assert d.status["completionTime"] == done.status["completionTime"]


def test_ttl_deletes_the_job_after_completion_and_requeues_until_then():
    j = job(workers=1, run_policy={"ttlSecondsAfterFinished": 100})
    done = step(j, [pod("mnist-worker-0", "Succeeded")], step(j, [], None).status)
    assert done.requeue_after_s == pytest.approx(100) and not done.delete_job
    later = step(j, [pod("mnist-worker-0", "Succeeded")], done.status, T0 + timedelta(seconds=40))
    assert later.requeue_after_s == pytest.approx(60) and not later.delete_job
    gone = step(j, [], done.status, T0 + timedelta(seconds=100))
    assert gone.delete_job


def test_suspend_deletes_pods_and_resume_recreates_them_with_a_new_start_time():
    running_job = job(workers=2)
    prev = step(running_job, running(running_job), step(running_job, [], None).status).status
    suspended_job = job(workers=2, run_policy={"suspend": True})
    d1 = step(suspended_job, running(suspended_job), prev, T0 + timedelta(minutes=1))
    assert d1.status["state"] == st.SUSPENDED
    assert set(d1.delete) == {"mnist-worker-0", "mnist-worker-1"}
    assert cond(d1.status, st.SUSPENDED)["status"] == "True"
    assert cond(d1.status, st.RUNNING)["status"] == "False"
    assert reasons(d1) == [st.REASON_SUSPENDED]
    d2 = step(suspended_job, [], d1.status, T0 + timedelta(minutes=2))
    assert d2.events == () and d2.create == ()
    d3 = step(running_job, [], d2.status, T0 + timedelta(minutes=10))
    assert d3.create == ("mnist-worker-0", "mnist-worker-1")
    assert d3.status["startTime"] == "2024-05-01T12:10:00Z"
    assert cond(d3.status, st.SUSPENDED)["status"] == "False"
    assert reasons(d3) == [st.REASON_RESUMED]


def test_suspended_time_does_not_count_against_the_deadline():
    rp = {"activeDeadlineSeconds": 120}
    prev = step(job(run_policy=rp), [], None).status
    susp = step(job(run_policy={**rp, "suspend": True}), [], prev, T0 + timedelta(seconds=60))
    resumed = step(job(run_policy=rp), [], susp.status, T0 + timedelta(seconds=600))
    j = job(run_policy=rp)
    d = step(j, running(j), resumed.status, T0 + timedelta(seconds=660))
    assert d.status["state"] == st.RUNNING


def test_replicas_scaled_down_delete_the_extra_pods():
    j = job(workers=1)
    d = step(j, [pod("mnist-worker-0"), pod("mnist-worker-1")], {"state": st.RUNNING})
    assert d.delete == ("mnist-worker-1",)


def test_progress_comes_from_the_live_status_then_the_termination_message():
    j = job(workers=2, chief=1)
    live = {
        "step": 120,
        "epoch": 0,
        "loss": 0.4123456789,
        "samples_per_s": 5100.5,
        "test_accuracy": None,
        "phase": "training",
    }
    d1 = step(j, running(j, **{"mnist-chief-0": pod("mnist-chief-0", live=live)}), None)
    assert d1.status["progress"] == {
        "step": 120,
        "epoch": 0,
        "loss": 0.412346,
        "samplesPerSecond": 5100.5,
    }
    final = json.dumps(
        {
            "event": "final",
            "steps": 400,
            "loss": 0.2,
            "test_accuracy": 0.91,
            "samples_per_s": 5000.0,
            "checkpoint": "/checkpoints/ckpt-400",
        }
    )
    d2 = step(
        j,
        running(j, **{"mnist-chief-0": pod("mnist-chief-0", "Succeeded", message=final)}),
        d1.status,
    )
    assert d2.status["progress"] == {
        "step": 400,
        "epoch": 0,
        "loss": 0.2,
        "testAccuracy": 0.91,
        "samplesPerSecond": 5000.0,
        "checkpoint": "/checkpoints/ckpt-400",
    }
    assert d2.status["state"] == st.SUCCEEDED


def test_progress_ignores_non_json_and_non_finite_values():
    j = job(workers=1)
    d = step(
        j,
        [
            pod(
                "mnist-worker-0",
                live={"step": 3, "loss": float("nan")},
                message="Traceback (most recent call last)",
            )
        ],
        None,
    )
    assert d.status["progress"] == {"step": 3}


def test_invalid_spec_fails_once_with_reason_and_removes_pods():
    d1 = lifecycle.derive_invalid([pod("mnist-worker-0")], T0, None, "spec.x: bad", generation=2)
    assert d1.status["state"] == st.FAILED and d1.status["observedGeneration"] == 2
    assert cond(d1.status, st.FAILED)["reason"] == st.REASON_INVALID
    assert d1.delete == ("mnist-worker-0",)
    assert [(e.type, e.reason, e.message) for e in d1.events] == [
        ("Warning", st.REASON_INVALID, "spec.x: bad")
    ]
    d2 = lifecycle.derive_invalid([], T0, d1.status, "spec.x: bad", generation=2)
    assert d2.events == () and d2.status == d1.status


def test_observed_pod_reads_a_real_pod_object():
    obj = {
        "metadata": {
            "name": "mnist-worker-1",
            "labels": {
                "ringtrain.io/job-name": "mnist",
                "ringtrain.io/replica-type": "worker",
                "ringtrain.io/replica-index": "1",
            },
        },
        "status": {
            "phase": "Failed",
            "podIP": "10.1.0.7",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "sidecar", "restartCount": 1, "state": {"running": {}}},
                {
                    "name": "ringtrain",
                    "restartCount": 0,
                    "state": {
                        "terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "{}"}
                    },
                },
            ],
        },
    }
    p = ObservedPod.from_pod(obj)
    assert (p.name, p.role, p.index, p.phase, p.ready, p.restarts) == (
        "mnist-worker-1",
        "worker",
        1,
        "Failed",
        False,
        1,
    )
    assert (p.exit_code, p.exit_reason, p.termination_message, p.pod_ip) == (
        137,
        "OOMKilled",
        "{}",
        "10.1.0.7",
    )
    assert not p.restarting and p.last_exit_code is None
    assert ObservedPod.from_pod({"metadata": {"name": "x", "labels": {}}}) is None


def _with_evaluator():
    from operator_jobs import job_obj

    from ringtrain_operator import spec

    return spec.load(
        job_obj(
            workers=1,
            chief=1,
            evaluator=1,
            trainer={"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "c"}}}},
        )
    )


def test_the_job_waits_for_the_built_in_evaluator_to_evaluate_the_last_checkpoint():
    j = _with_evaluator()
    d1 = step(j, running(j), None)
    done = {
        "mnist-chief-0": pod("mnist-chief-0", "Succeeded", exit_code=0),
        "mnist-worker-0": pod("mnist-worker-0", "Succeeded", exit_code=0),
    }
    d2 = step(j, running(j, **done), d1.status)
    assert d2.status["state"] != st.SUCCEEDED and "mnist-evaluator-0" not in d2.delete
    d3 = step(
        j,
        running(
            j, **done, **{"mnist-evaluator-0": pod("mnist-evaluator-0", "Succeeded", exit_code=0)}
        ),
        d2.status,
    )
    assert d3.status["state"] == st.SUCCEEDED


def test_a_stock_evaluator_does_not_hold_the_job_back():
    j = job(workers=1, chief=1, ps=1, evaluator=1)  # no spec.trainer
    d = step(
        j, running(j, **{"mnist-chief-0": pod("mnist-chief-0", "Succeeded", exit_code=0)}), None
    )
    assert d.status["state"] == st.SUCCEEDED and "mnist-evaluator-0" in d.delete


def test_the_evaluators_last_evaluation_and_the_export_appear_in_the_status():
    j = _with_evaluator()
    live = {"step": 20, "epoch": 0, "test_accuracy": 0.81, "test_loss": 0.6, "phase": "Evaluating"}
    d1 = step(j, running(j, **{"mnist-evaluator-0": pod("mnist-evaluator-0", live=live)}), None)
    assert d1.status["evaluation"] == {"step": 20, "testLoss": 0.6, "testAccuracy": 0.81}
    starting = {"step": 0, "epoch": 0, "test_accuracy": None, "phase": "Evaluating"}
    d0 = step(j, running(j, **{"mnist-evaluator-0": pod("mnist-evaluator-0", live=starting)}), None)
    assert "evaluation" not in d0.status
    final = {
        "event": "final",
        "steps": 30,
        "test_accuracy": 0.85,
        "test_loss": 0.5,
        "checkpoint": "/checkpoints/ckpt-0000000030.json",
        "evaluations": 3,
    }
    chief = {
        "event": "final",
        "steps": 30,
        "test_accuracy": 0.85,
        "export": "/checkpoints/model.keras",
    }
    d2 = step(
        j,
        running(
            j,
            **{
                "mnist-evaluator-0": pod(
                    "mnist-evaluator-0", "Succeeded", exit_code=0, message=json.dumps(final)
                ),
                "mnist-chief-0": pod(
                    "mnist-chief-0", "Succeeded", exit_code=0, message=json.dumps(chief)
                ),
            },
        ),
        d1.status,
    )
    assert d2.status["evaluation"] == {
        "step": 30,
        "testLoss": 0.5,
        "testAccuracy": 0.85,
        "checkpoint": "/checkpoints/ckpt-0000000030.json",
        "evaluations": 3,
    }
    assert d2.status["progress"]["export"] == "/checkpoints/model.keras"


def _container(policy: str, state: dict, last: dict | None = None, phase: str = "Running"):
    cs = {"name": "ringtrain", "restartCount": 1, "state": state}
    if last is not None:
        cs["lastState"] = {"terminated": last}
    return ObservedPod.from_pod(
        {
            "metadata": {
                "name": "mnist-worker-1",
                "labels": {
                    "ringtrain.io/job-name": "mnist",
                    "ringtrain.io/replica-type": "worker",
                    "ringtrain.io/replica-index": "1",
                },
            },
            "spec": {"restartPolicy": policy},
            "status": {"phase": phase, "containerStatuses": [cs]},
        }
    )


def test_observed_pod_reads_a_restart_in_place():
    p = _container("OnFailure", {"running": {}}, {"exitCode": 137, "reason": "Error"})
    assert (p.restarting, p.restarts, p.last_exit_code, p.last_exit_reason, p.exit_code) == (
        False,
        1,
        137,
        "Error",
        None,
    )
    # Between the exit and the kubelet's restart: terminated now, or waiting in back-off.
    assert _container("OnFailure", {"terminated": {"exitCode": 138}}).restarting
    assert _container("Always", {"terminated": {"exitCode": 0}}).restarting
    assert _container(
        "OnFailure", {"waiting": {"reason": "CrashLoopBackOff"}}, {"exitCode": 2}
    ).restarting
    # Not restarted: a success under OnFailure, anything under Never, a pod that is over.
    assert not _container("OnFailure", {"terminated": {"exitCode": 0}}).restarting
    assert not _container("Never", {"terminated": {"exitCode": 137}}).restarting
    assert not _container("OnFailure", {"terminated": {"exitCode": 137}}, phase="Failed").restarting
    assert not _container("OnFailure", {"waiting": {"reason": "ContainerCreating"}}).restarting


def test_progress_shows_the_chiefs_ipu_memory_report_and_keeps_it_after_the_end():
    j = job(workers=1)
    kinds = {
        "weights": 1000,
        "gradients": 1000,
        "activations": 5000,
        "workspace": 3000,
        "data": 200,
        "optimizer_state": 0,
    }
    report = {
        "capacity": 900 << 20,
        "total": 10200,
        "kinds": kinds,
        "layers": [{"name": "dense", **kinds}],
        "host": {"optimizer_state": 2000},
    }
    d1 = step(j, [pod("mnist-worker-0", live={"step": 2, "ipu_memory": report})], None)
    assert d1.status["progress"] == {
        "step": 2,
        "ipuMemory": {
            "capacityBytes": 900 << 20,
            "totalBytes": 10200,
            "weightsBytes": 1000,
            "gradientsBytes": 1000,
            "activationsBytes": 5000,
            "workspaceBytes": 3000,
            "dataBytes": 200,
            "optimizerStateBytes": 0,
            "hostOptimizerStateBytes": 2000,
        },
    }
    # the termination message has no report: the last one seen stays in the status
    final = json.dumps({"event": "final", "steps": 5, "loss": 0.2})
    d2 = step(j, [pod("mnist-worker-0", "Succeeded", message=final)], d1.status)
    assert d2.status["progress"]["ipuMemory"] == d1.status["progress"]["ipuMemory"]
    assert d2.status["progress"]["step"] == 5


def test_a_malformed_ipu_memory_report_is_left_out():
    j = job(workers=1)
    for bad in ("x", {"kinds": "x"}, {"kinds": {"weights": "many", "data": True}}, None):
        d = step(j, [pod("mnist-worker-0", live={"step": 2, "ipu_memory": bad})], None)
        assert d.status["progress"] == {"step": 2}, bad


def test_the_running_message_names_the_ring_members_the_chief_still_waits_for():
    """The chief's /status lists the peers it has not heard from at start-up (the readiness
    barrier); the job's Running condition names them, and forgets them once the ring formed."""
    j = job(workers=3)
    d0 = step(j, running(j), None)
    waiting = {"step": 0, "epoch": 0, "phase": "Starting", "waiting_for": ["worker-2"]}
    d1 = step(j, running(j, **{"mnist-worker-0": pod("mnist-worker-0", live=waiting)}), d0.status)
    assert cond(d1.status, st.RUNNING)["message"] == "waiting for worker-2"
    assert d1.status["progress"]["waitingFor"] == ["worker-2"]
    trained = {"step": 5, "epoch": 0, "loss": 1.5, "phase": "Training"}
    d2 = step(j, running(j, **{"mnist-worker-0": pod("mnist-worker-0", live=trained)}), d1.status)
    assert cond(d2.status, st.RUNNING)["message"] == "all pods are running"
    assert "waitingFor" not in d2.status["progress"] and d2.status["progress"]["step"] == 5


def test_a_worker_killed_for_memory_is_named_oomkilled_with_its_limit():
    """Issue 20: an OOMKilled container is named as such, with the limit it hit, in the
    Restarting condition and Event (in place) and in the Failed one (backoffLimit reached). The
    pod as the kubelet reports it: ``lastState.terminated.reason`` and the spec's limit."""
    from ringtrain_operator import manifests

    j = job(workers=2)
    obj = manifests.pod(j, j.replica("worker"), 1)
    limit = obj["spec"]["containers"][0]["resources"]["limits"]["memory"]
    obj["status"] = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "ringtrain",
                "restartCount": 1,
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            }
        ],
    }
    oom = ObservedPod.from_pod(obj)
    assert (oom.memory_limit, oom.last_exit_reason) == (limit, "OOMKilled")
    prev = step(j, running(j), None).status
    d = step(j, [pod("mnist-worker-0"), oom], prev)
    said = (
        "pod mnist-worker-1 failed with exit code 137 "
        f"(OOMKilled: out of memory at its limit of {limit})"
    )
    assert d.status["state"] == st.RESTARTING
    assert d.events[0].message.startswith(said + ": restarting in place")
    assert cond(d.status, st.RESTARTING)["message"].startswith(said)
    capped = job(workers=2, run_policy={"backoffLimit": 0})
    d = step(capped, [pod("mnist-worker-0"), oom], step(capped, running(capped), None).status)
    assert d.status["state"] == st.FAILED and said in d.events[-1].message
