"""A running elastic job resized by editing Worker.replicas (issue 38, decision 0217): the job at
the edited count (:func:`elastic.running_at`), and the fold's resize phase (:mod:`.resizing`):
the size annotation patched onto the pods that stay, the pods beyond deleted, the missing
created, the resize seen done when the chief reports a ring of the new size."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import pytest
from operator_jobs import job_obj
from test_elastic_policy import elastic_obj
from test_status import T0, pod, reasons

from ringtrain_operator import elastic, manifests, resizing, spec
from ringtrain_operator.lifecycle import derive_status
from ringtrain_operator.reconcile import load_spec


def admitted(obj: dict) -> dict:
    """``obj`` with the status its first reconcile writes."""
    j = spec.load(obj)
    return {**obj, "status": {"elastic": elastic.admitted(j), "state": "Running"}}


def at(obj: dict, workers: int, **policy) -> dict:
    out = json.loads(json.dumps(obj))
    out["spec"]["replicaSpecs"]["Worker"]["replicas"] = workers
    out["spec"]["elasticPolicy"].update(policy)
    return out


BASE = elastic_obj(workers=2, batch=120, minReplicas=1, maxReplicas=3)


def test_an_edited_count_runs_with_its_share_of_the_global_batch_of_the_jobs_creation():
    running = admitted(BASE)
    j = load_spec(elastic.running_at(at(running, 3))[0])
    assert (j.replica("worker").replicas, j.trainer.batch_size) == (3, 80)
    assert j.elastic.global_batch == 240  # not 120 x 3
    obj, why = elastic.running_at(at(running, 1))
    assert (spec.load(obj).trainer.batch_size, why) == (240, "")
    # before its first status nothing is known: the spec as written
    assert elastic.running_at(at(BASE, 3)) == (at(BASE, 3), "")


@pytest.mark.parametrize(
    ("workers", "policy", "why"),
    [
        (
            4,
            {},
            "spec.replicaSpecs.Worker.replicas: 4 is outside spec.elasticPolicy's "
            "[minReplicas, maxReplicas] = [1, 3]",
        ),
        (
            2,
            {"maxReplicas": 7},
            "spec.elasticPolicy: [minReplicas, maxReplicas] = [1, 7] is refused: the job's "
            "global batch 240 does not divide evenly among 7 workers",
        ),
        (
            2,
            {"minReplicas": 3, "maxReplicas": 2},
            "spec.elasticPolicy.minReplicas: 3 is more than maxReplicas 2",
        ),
    ],
)
def test_a_refused_edit_keeps_the_running_count_and_names_the_field(workers, policy, why):
    obj, got = elastic.running_at(at(admitted(BASE), workers, **policy))
    assert got == f"{why}; the job goes on with 2 workers"
    j = spec.load(obj)  # admitted: the job is never failed for an edit
    assert (j.replica("worker").replicas, j.trainer.batch_size) == (2, 120)


def test_an_edited_batch_size_is_said_not_applied():
    edited = at(admitted(BASE), 3)
    edited["spec"]["trainer"]["batchSize"] = 100
    obj, why = elastic.running_at(edited)
    assert spec.load(obj).trainer.batch_size == 80
    assert why.startswith("spec.trainer.batchSize: 100 is not applied to a running elastic job")
    edited["spec"]["trainer"]["batchSize"] = 80  # the share, written out: nothing to say
    assert elastic.running_at(edited)[1] == ""


def size_of(j, index: int) -> str:
    return elastic.size_document(j, manifests.tf_config(j, "worker", index))


def worker(j, index: int, size_job=None, **kw):
    """A running worker pod of ``j`` carrying the size annotation of ``size_job`` (default j)."""
    p = pod(j.pod_name("worker", index), **kw)
    return dataclasses.replace(p, elastic=size_of(size_job or j, index))


def test_a_pod_carries_its_size_as_an_annotation_the_downward_api_projects():
    j = spec.load(BASE)
    p = manifests.pod(j, j.replica("worker"), 1)
    doc = json.loads(p["metadata"]["annotations"][elastic.ANNOTATION])
    assert (doc["workers"], doc["batchSize"]) == (2, 120)
    assert json.loads(doc["tfConfig"]) == json.loads(manifests.tf_config(j, "worker", 1))
    main = p["spec"]["containers"][0]
    assert {"name": elastic.SIZE_ENV, "value": elastic.SIZE_FILE} in main["env"]
    vol = next(v for v in p["spec"]["volumes"] if v["name"] == "elastic")
    assert vol["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['ringtrain.io/elastic']"
    )
    fixed = spec.load(job_obj(workers=2, trainer={"dataset": "mnist-5k", "batchSize": 8}))
    fp = manifests.pod(fixed, fixed.replica("worker"), 1)
    assert elastic.ANNOTATION not in fp["metadata"].get("annotations", {})
    assert all(v["name"] != "elastic" for v in fp["spec"]["volumes"])


def test_a_grown_job_patches_the_pods_that_stay_creates_the_new_and_is_done_at_the_new_ring():
    running = admitted(BASE)
    before = load_spec(elastic.running_at(running)[0])
    j = load_spec(elastic.running_at(at(running, 3))[0])
    pods = [worker(before, 0, live={"step": 40, "ring_size": 2}), worker(before, 1)]
    d = derive_status(j, pods, T0, running["status"])
    assert "Resizing" in reasons(d)
    assert d.status["elastic"]["workers"] == 3
    assert d.status["elastic"]["resizing"]["from"] == 2
    assert dict(d.annotate) == {p.name: size_of(j, p.index) for p in pods}
    assert json.loads(dict(d.annotate)[pods[0].name])["batchSize"] == 80
    assert d.create == (j.pod_name("worker", 2),) and d.delete == ()

    # the next look: the pods carry the new size; nothing more to patch, not done yet
    now = [worker(j, 0, live={"step": 41, "ring_size": 2}), worker(j, 1), worker(j, 2)]
    d2 = derive_status(j, now, T0 + timedelta(seconds=1), d.status)
    assert d2.annotate == () and "Resizing" not in reasons(d2) and "Resized" not in reasons(d2)
    assert d2.requeue_after_s == resizing.LOOK_AGAIN_S  # the chief is asked again soon
    # the chief reports the ring of 3, re-formed from step 41 in 2.5 s
    live = {"step": 43, "ring_size": 3, "resize_step": 41, "resize_s": 2.5}
    now[0] = worker(j, 0, live=live)
    d3 = derive_status(j, now, T0 + timedelta(seconds=9), d2.status)
    assert "Resized" in reasons(d3)
    assert d3.status["elastic"]["lastResize"] == {
        "from": 2,
        "to": 3,
        "step": 41,
        "seconds": 9.0,
        "ringSeconds": 2.5,
    }
    assert d3.status["elastic"]["resizes"] == 1 and "resizing" not in d3.status["elastic"]


def test_a_shrunk_job_deletes_the_pods_beyond_and_patches_those_that_stay():
    running = admitted(elastic_obj(workers=3, batch=80, minReplicas=1, maxReplicas=3))
    before = load_spec(elastic.running_at(running)[0])
    j = load_spec(elastic.running_at(at(running, 2))[0])
    pods = [worker(before, i) for i in range(3)]
    d = derive_status(j, pods, T0, running["status"])
    assert d.delete == (j.pod_name("worker", 2),)
    assert sorted(dict(d.annotate)) == [j.pod_name("worker", i) for i in (0, 1)]
    assert json.loads(dict(d.annotate)[j.pod_name("worker", 0)])["batchSize"] == 120


def test_a_refused_edit_is_said_once_and_nothing_moves():
    running = admitted(BASE)
    obj, why = elastic.running_at(at(running, 9))
    j = load_spec(obj)
    j = dataclasses.replace(j, elastic=dataclasses.replace(j.elastic, refused=why))
    pods = [worker(j, 0), worker(j, 1)]
    d = derive_status(j, pods, T0, running["status"])
    assert [e.reason for e in d.events if e.type == "Warning"] == [resizing.REASON_REFUSED]
    assert d.annotate == () and d.create == () and d.delete == ()
    d2 = derive_status(j, pods, T0, d.status)
    assert resizing.REASON_REFUSED not in reasons(d2)


def test_a_worker_lost_past_the_grace_shrinks_the_job_which_grows_back_when_it_runs():
    running = admitted(BASE)  # 2 workers, minReplicas 1, shrinkAfterSeconds 60 by default
    j2 = load_spec(elastic.running_at(running)[0])
    assert j2.elastic.shrink_after_s == elastic.SHRINK_AFTER_S == 60
    chief = worker(j2, 0, live={"step": 50, "ring_size": 2})
    pending = worker(j2, 1, phase="Pending", ready=False)
    d = derive_status(j2, [chief, pending], T0, running["status"])
    assert d.status["elastic"]["lost"] == {pending.name: "2024-05-01T12:00:00Z"}
    assert "shrunkTo" not in d.status["elastic"] and d.requeue_after_s == 60
    d = derive_status(j2, [chief, pending], T0 + timedelta(seconds=59), d.status)
    assert "shrunkTo" not in d.status["elastic"] and d.requeue_after_s == 1
    d = derive_status(j2, [chief, pending], T0 + timedelta(seconds=60), d.status)
    assert d.status["elastic"]["shrunkTo"] == 1 and "lost" not in d.status["elastic"]
    assert [e.reason for e in d.events if e.type == "Warning"] == [resizing.REASON_LOST]

    # the job at 1: worker 0 re-sized, the lost worker's pod kept (pending its node)
    j1 = load_spec(elastic.running_at({**running, "status": d.status})[0])
    assert (j1.replica("worker").replicas, j1.trainer.batch_size) == (1, 240)
    d = derive_status(j1, [chief, pending], T0 + timedelta(seconds=61), d.status)
    assert "Resizing" in reasons(d) and d.delete == () and d.create == ()
    assert dict(d.annotate) == {chief.name: size_of(j1, 0)}

    # its pod runs again: the job grows back to 2
    back, chief = worker(j2, 1), worker(j1, 0, live={"step": 80, "ring_size": 1})
    d = derive_status(j1, [chief, back], T0 + timedelta(seconds=90), d.status)
    assert resizing.REASON_RETURNED in reasons(d) and "shrunkTo" not in d.status["elastic"]
    assert d.delete == ()  # the pod that came back is kept while the job grows back to it
    j2again = load_spec(elastic.running_at({**running, "status": d.status})[0])
    assert j2again.replica("worker").replicas == 2
    d = derive_status(j2again, [chief, back], T0 + timedelta(seconds=91), d.status)
    assert d.status["elastic"]["resizing"]["to"] == 2 and "growing" not in d.status["elastic"]
    assert dict(d.annotate) == {chief.name: size_of(j2again, 0)}


def test_below_min_replicas_a_lost_worker_is_waited_for_as_in_any_job():
    obj = elastic_obj(workers=2, batch=120, minReplicas=2, maxReplicas=3, shrinkAfterSeconds=5)
    running = admitted(obj)
    j = load_spec(elastic.running_at(running)[0])
    pods = [worker(j, 0), worker(j, 1, phase="Pending", ready=False)]
    d = derive_status(j, pods, T0, running["status"])
    d = derive_status(j, pods, T0 + timedelta(seconds=30), d.status)
    assert "shrunkTo" not in d.status["elastic"] and resizing.REASON_LOST not in reasons(d)


def test_a_lost_worker_beyond_a_new_count_is_forgotten():
    running = admitted(elastic_obj(workers=3, batch=80, minReplicas=1, maxReplicas=3))
    j3 = load_spec(elastic.running_at(running)[0])
    pods = [worker(j3, 0), worker(j3, 1), worker(j3, 2, phase="Pending", ready=False)]
    d = derive_status(j3, pods, T0, running["status"])
    assert list(d.status["elastic"]["lost"]) == [pods[2].name]
    j2 = load_spec(elastic.running_at({**at(running, 2), "status": d.status})[0])
    d = derive_status(j2, pods, T0 + timedelta(seconds=1), d.status)
    assert "lost" not in d.status["elastic"] and d.delete == (pods[2].name,)


def test_processes_that_cannot_learn_a_size_in_place_are_not_shrunk_around():
    """`ringtrain run`'s processes carry no size annotation: a local job is resized by
    `ringtrain scale` alone, never shrunk on a loss it could not carry out."""
    running = admitted(BASE)
    j = load_spec(elastic.running_at(running)[0])
    local = [pod(j.pod_name("worker", 0)), pod(j.pod_name("worker", 1), "Pending", ready=False)]
    d = derive_status(j, local, T0, running["status"])
    d = derive_status(j, local, T0 + timedelta(seconds=600), d.status)
    assert "lost" not in d.status["elastic"] and "shrunkTo" not in d.status["elastic"]
    assert resizing.REASON_LOST not in reasons(d)
