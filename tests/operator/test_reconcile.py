"""reconcile(): observe, fold, write status first, act; idempotent across operator restarts."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from fake_kube import FakeKube
from operator_jobs import job_obj
from prometheus_client import CollectorRegistry

from ringtrain_operator import status as st
from ringtrain_operator.metrics import OperatorMetrics
from ringtrain_operator.reconcile import reconcile, status_patch

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def no_fetch(ip):
    raise AssertionError("no live status expected")


def pods(kube):
    return sorted(name for kind, name in kube.objects if kind == "Pod")


def test_first_reconcile_creates_service_secret_pods_and_status():
    kube = FakeKube(job_obj(workers=2))
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert sorted(kube.objects) == [
        ("Pod", "mnist-worker-0"),
        ("Pod", "mnist-worker-1"),
        ("Secret", "mnist-ring-token"),
        ("Service", "mnist"),
    ]
    assert kube.calls[0] == ("patch", "status")  # status is written before any action
    assert kube.job["status"]["state"] == st.CREATED
    assert [e.reason for e in d.events] == [st.REASON_CREATED, "PodCreated", "PodCreated"]


def test_a_restarted_operator_creates_nothing_twice_and_keeps_the_first_token():
    kube = FakeKube(job_obj(workers=2))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    token = kube.objects[("Secret", "mnist-ring-token")]["data"]["token"]
    del kube.objects[("Pod", "mnist-worker-1")]
    kube.job["status"] = {}  # as if the status write had been lost too
    kube.calls.clear()
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert pods(kube) == ["mnist-worker-0", "mnist-worker-1"]
    assert kube.objects[("Secret", "mnist-ring-token")]["data"]["token"] == token
    assert [e.message for e in d.events if e.reason == "PodCreated"] == [
        "created pod mnist-worker-1"
    ]
    assert len(base64.b64decode(token)) >= 32


def test_progress_is_read_from_the_running_chief_only():
    kube = FakeKube(job_obj(workers=2))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    kube.set_pod_phase("mnist-worker-0", "Running")
    kube.set_pod_phase("mnist-worker-1", "Running")
    asked = []

    def fetch(ip):
        asked.append(ip)
        return {"step": 7, "loss": 1.5, "samples_per_s": 900.0, "phase": "training"}

    reconcile(kube, "team-a", "mnist", now=T0, fetch=fetch)
    assert asked == ["10.1.0.9"]
    assert kube.job["status"]["progress"] == {"step": 7, "loss": 1.5, "samplesPerSecond": 900.0}
    assert kube.job["status"]["state"] == st.RUNNING


def test_in_place_restart_then_success_then_ttl_deletes_the_job():
    obj = job_obj(workers=2, run_policy={"ttlSecondsAfterFinished": 0})
    kube = FakeKube(obj)
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)

    def run():
        return reconcile(kube, "team-a", "mnist", now=T0, fetch=lambda ip: None, metrics=metrics)

    run()
    uids = {n: kube.objects[("Pod", n)]["metadata"].get("uid") for n in pods(kube)}
    kube.set_pod_phase("mnist-worker-0", "Running")
    kube.set_pod_phase("mnist-worker-1", "Running")
    run()
    kube.restart_in_place("mnist-worker-1", 137)  # the kubelet restarted it in its pod
    kube.restart_in_place("mnist-worker-0", 138)  # its peer left the ring and did the same
    d = run()
    assert kube.job["status"]["state"] == st.RESTARTING
    assert kube.job["status"]["restarts"] == 2
    assert [e.reason for e in d.events] == [st.REASON_RESTARTING]  # nothing deleted or created
    assert "pod mnist-worker-1 failed with exit code 137" in d.events[0].message
    assert pods(kube) == ["mnist-worker-0", "mnist-worker-1"]
    assert {n: kube.objects[("Pod", n)]["metadata"].get("uid") for n in pods(kube)} == uids
    run()
    assert kube.job["status"]["state"] == st.RUNNING
    kube.set_pod_phase("mnist-worker-0", "Succeeded", exit_code=0)
    d = run()
    assert d.delete_job and kube.job is None
    assert pods(kube) == ["mnist-worker-0"]  # cleanPodPolicy Running removed the running one
    value = registry.get_sample_value
    assert value("ringtrain_operator_jobs_created_total", {"job_namespace": "team-a"}) == 1
    assert value("ringtrain_operator_jobs_restarted_total", {"job_namespace": "team-a"}) == 1
    assert value("ringtrain_operator_jobs_succeeded_total", {"job_namespace": "team-a"}) == 1
    assert value("ringtrain_operator_jobs", {"state": "Succeeded"}) == 1
    assert value("ringtrain_operator_jobs", {"state": "Running"}) == 0
    assert value("ringtrain_operator_reconcile_duration_seconds_count") == 5
    assert value("ringtrain_operator_info", {"version": "0.1.0"}) == 1
    assert reconcile(kube, "team-a", "mnist", now=T0) is None


def test_a_lost_pod_alone_is_deleted_then_recreated():
    kube = FakeKube(job_obj(workers=2))
    run = lambda: reconcile(kube, "team-a", "mnist", now=T0, fetch=lambda ip: None)  # noqa: E731
    run()
    kube.set_pod_phase("mnist-worker-0", "Running")
    kube.set_pod_phase("mnist-worker-1", "Failed")  # evicted: no exit code
    d = run()
    assert kube.job["status"]["state"] == st.RESTARTING
    assert (kube.job["status"]["restarts"], kube.job["status"]["gangRestarts"]) == (1, 1)
    assert [e.message for e in d.events if e.reason == "PodDeleted"] == [
        "deleted pod mnist-worker-1"
    ]
    assert pods(kube) == ["mnist-worker-0"]
    d = run()
    assert [e.message for e in d.events if e.reason == "PodCreated"] == [
        "created pod mnist-worker-1"
    ]
    assert pods(kube) == ["mnist-worker-0", "mnist-worker-1"]
    assert kube.job["status"]["restarts"] == 1


def test_invalid_spec_is_recorded_as_failed_without_raising():
    obj = job_obj(workers=2)
    obj["spec"]["trainer"].update(batchSize=10, ipusPerWorker=4)
    kube = FakeKube(obj)
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == st.FAILED
    assert [(e.type, e.reason) for e in d.events] == [("Warning", st.REASON_INVALID)]
    assert "spec.trainer.batchSize" in kube.job["status"]["conditions"][0]["message"]
    assert pods(kube) == []


def test_steady_state_writes_nothing():
    kube = FakeKube(job_obj(workers=1))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    kube.set_pod_phase("mnist-worker-0", "Pending")
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    kube.calls.clear()
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.calls == [] and d.events == ()


def test_status_patch_sets_changed_keys_and_removes_missing_ones():
    assert status_patch({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5}) == {"b": 5, "c": None}


def test_status_patch_removes_a_key_gone_from_a_nested_object():
    """The API server merges nested objects (RFC 7386): a key dropped from one is sent as null,
    else it would stay (an elastic job's finished resize, a chief's stale waitingFor)."""
    old = {"elastic": {"workers": 3, "resizing": {"to": 3}}, "progress": {"waitingFor": ["w"]}}
    new = {"elastic": {"workers": 3, "resizes": 1}, "progress": {"step": 4}}
    patch = status_patch(old, new)
    assert patch == {
        "elastic": {"resizing": None, "resizes": 1},
        "progress": {"step": 4, "waitingFor": None},
    }
    from fake_kube import merge_patch

    merge_patch(old, patch)
    assert old == new


def test_an_unsupported_inline_keras_model_fails_the_job_with_an_event_naming_the_layer():
    obj = job_obj(workers=2)
    obj["spec"]["trainer"]["model"] = {
        "class_name": "Sequential",
        "config": {
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_input_shape": [None, 28, 28]}},
                {"class_name": "Flatten", "config": {"name": "flatten"}},
                {
                    "class_name": "Dense",
                    "config": {"name": "out", "units": 10, "activation": "sparsemax"},
                },
            ]
        },
    }
    kube = FakeKube(obj)
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == st.FAILED
    assert [(e.type, e.reason) for e in d.events] == [("Warning", st.REASON_INVALID)]
    message = kube.job["status"]["conditions"][0]["message"]
    assert "spec.trainer.model: layer 'out' (Dense): activation='sparsemax'" in message
    assert "relu" in d.events[0].message and pods(kube) == []


def test_a_jobs_spec_is_loaded_once_and_again_when_it_changes_and_an_invalid_one_every_time():
    """load_spec (issue 22): a job's later reconciles reuse its loaded spec while its spec, uid
    and generation are the same; any change loads it again (even without a new generation),
    and an invalid spec is refused each time."""
    import pytest

    from ringtrain.errors import InvalidSpec
    from ringtrain_operator.reconcile import forget_spec, load_spec

    obj = job_obj(workers=2)
    first = load_spec(obj)
    assert load_spec(obj) is first
    obj["spec"]["replicaSpecs"]["Worker"]["replicas"] = 3
    assert len(load_spec(obj).members()) == 3
    obj["metadata"]["generation"] = 2
    assert load_spec(obj).generation == 2
    forget_spec("team-a", "mnist")
    assert load_spec(obj) is not load_spec(job_obj(workers=3))  # another spec
    obj["spec"]["trainer"] = {"steps": 5, "epochs": 1}
    for _ in range(2):
        with pytest.raises(InvalidSpec, match="steps or epochs"):
            load_spec(obj)
    forget_spec("team-a", "mnist")
