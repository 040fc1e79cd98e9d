"""observe: Pod objects → ObservedPods, the running chief's /status, progress from the chief."""

from __future__ import annotations

import json

from operator_jobs import job

from ringtrain_operator import kinds, lifecycle, manifests, observe, status
from ringtrain_operator.observe import ObservedPod


def pod_obj(j, role: str, index: int, phase: str = "Running", ip: str = "10.1.0.5") -> dict:
    obj = manifests.pod(j, j.replica(role), index)
    obj["status"] = {"phase": phase, "podIP": ip}
    return obj


def test_pods_of_the_job_are_observed_and_unlabelled_ones_skipped():
    j = job(workers=2)
    objs = [
        pod_obj(j, "worker", 0),
        pod_obj(j, "worker", 1, "Pending"),
        {"metadata": {"name": "stray", "labels": {manifests.LABEL_JOB: "mnist"}}},
    ]
    seen = observe.observe_pods(j, objs, fetch=lambda ip: {"step": 1})
    assert [(p.name, p.role, p.index, p.phase) for p in seen] == [
        ("mnist-worker-0", "worker", 0, "Running"),
        ("mnist-worker-1", "worker", 1, "Pending"),
    ]
    assert seen[0].live_status == {"step": 1} and seen[1].live_status is None


def test_only_the_running_chief_of_a_trainer_job_is_asked_for_its_status():
    asked = []

    def fetch(ip):
        asked.append(ip)
        return {"step": 2}

    j = job(workers=2, chief=1)
    objs = [pod_obj(j, "chief", 0, ip="10.0.0.1"), pod_obj(j, "worker", 0, ip="10.0.0.2")]
    seen = observe.observe_pods(j, objs, fetch)
    assert asked == ["10.0.0.1"] and [p.live_status for p in seen] == [{"step": 2}, None]
    observe.observe_pods(j, [pod_obj(j, "chief", 0, "Succeeded")], fetch)
    observe.observe_pods(None, objs, fetch)  # an invalid spec: nobody is asked
    assert asked == ["10.0.0.1"]


def test_the_running_evaluator_is_asked_for_its_status_too():
    asked = []
    j = job(workers=1, evaluator=1)
    objs = [pod_obj(j, "worker", 0, ip="10.0.0.2"), pod_obj(j, "evaluator", 0, ip="10.0.0.3")]
    seen = observe.observe_pods(j, objs, lambda ip: asked.append(ip) or {"step": 5})
    assert asked == ["10.0.0.2", "10.0.0.3"] and seen[1].live_status == {"step": 5}


def test_chief_progress_prefers_the_final_termination_message():
    j = job(workers=1)
    chief = ObservedPod("mnist-worker-0", "worker", 0, live_status={"step": 5, "loss": 1.0})
    assert observe.progress_of(kinds.of(j).reporter(j, [chief])) == {"step": 5, "loss": 1.0}
    final = ObservedPod(
        "mnist-worker-0",
        "worker",
        0,
        phase="Succeeded",
        termination_message=json.dumps({"steps": 9, "checkpoint": "/c/9"}),
    )
    assert observe.progress_of(kinds.of(j).reporter(j, [final])) == {
        "step": 9,
        "checkpoint": "/c/9",
    }
    other = ObservedPod("mnist-worker-1", "worker", 1, live_status={"step": 5})
    assert observe.progress_of(kinds.of(j).reporter(j, [other])) == {}


def test_status_reads_observed_pods_it_does_not_parse_them():
    assert status.ObservedPod is ObservedPod
    assert "manifests" not in vars(status)


def test_the_decision_carries_the_members_to_create():
    j = job(workers=2, chief=1)
    d = lifecycle.derive_status(j, [], status.parse_time("2024-05-01T12:00:00Z"), None)
    assert [(m.name, m.replica.role, m.index) for m in d.to_create] == [
        ("mnist-chief-0", "chief", 0),
        ("mnist-worker-0", "worker", 0),
        ("mnist-worker-1", "worker", 1),
    ]
    assert d.create == tuple(m.name for m in d.to_create)
    assert [manifests.pod(j, m.replica, m.index) for m in d.to_create] == manifests.pods(j)
