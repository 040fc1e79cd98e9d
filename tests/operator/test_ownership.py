"""Issue 35, items 3 and 4 in the operator: only what a job controls is the job's, and a create
the API server refuses for good is a verdict, not a retry loop. Each test plants objects in the
fake API server (tests/operator/fake_kube.py) or makes it refuse, and drives reconcile; each
failed on the code before (a 409 was "done", pods were chosen by label, a 422 was retried)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from fake_kube import FakeKube
from kubernetes.client import ApiException
from operator_jobs import job_obj
from test_mpi_job import mpi_job

from ringtrain_operator import manifests, status, verdicts
from ringtrain_operator.reconcile import reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def no_fetch(ip):
    raise AssertionError("no pod's /status may be read")


def planted(kind: str, name: str, namespace: str, owner: dict | None = None, **more) -> dict:
    """An object someone else created under a job's names: its own ownerReference, or none."""
    meta: dict = {"name": name, "namespace": namespace, "labels": more.pop("labels", {})}
    if owner is not None:
        meta["ownerReferences"] = [{"controller": True, **owner}]
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, **more}


def condition(kube: FakeKube, ctype: str) -> dict:
    return next(c for c in kube.job["status"]["conditions"] if c["type"] == ctype)


def assert_settled(kube: FakeKube, namespace: str, name: str) -> None:
    """The next reconcile of the failed job makes no API call and posts no Event: no loop."""
    kube.calls.clear()
    again = reconcile(kube, namespace, name, now=T0, fetch=no_fetch)
    assert kube.calls == [] and again.events == ()


@pytest.mark.parametrize("kind", ["Secret", "ConfigMap"])
def test_an_mpi_jobs_secret_or_configmap_planted_before_it_exists_fails_it_naming_the_object(kind):
    """Before: the 409 was taken as done, and the workers mounted the planter's SSH key pair
    (or hostfile and sshd_config)."""
    name = {"Secret": "hvd-ssh", "ConfigMap": "hvd-mpi"}[kind]
    kube = FakeKube(mpi_job())
    mine = planted(kind, name, "team", data={"ssh-privatekey": "cGxhbnRlZA=="})
    kube.objects[(kind, name)] = mine
    d = reconcile(kube, "team", "hvd", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.FAILED
    failed = condition(kube, status.FAILED)
    assert failed["reason"] == status.REASON_RESOURCE_EXISTS == "ResourceExists"
    assert failed["message"].startswith(
        f"{kind} team/{name} already exists and is not owned by this TrainingJob (uid u-1"
    )
    assert [(e.type, e.reason) for e in d.events][-1] == ("Warning", "ResourceExists")
    assert not [k for k in kube.objects if k[0] == "Pod"]  # no pod mounts it
    assert kube.objects[(kind, name)] == mine  # and it is left alone
    assert_settled(kube, "team", "hvd")


def test_a_ring_jobs_token_secret_owned_by_another_job_fails_it():
    kube = FakeKube(job_obj(workers=2))
    other = {"apiVersion": "ringtrain.io/v1alpha1", "kind": "TrainingJob", "name": "x", "uid": "9"}
    kube.objects[("Secret", "mnist-ring-token")] = planted(
        "Secret", "mnist-ring-token", "team-a", other
    )
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    failed = condition(kube, status.FAILED)
    assert failed["reason"] == "ResourceExists"
    assert "it has controller TrainingJob x (uid 9)" in failed["message"]
    assert not [k for k in kube.objects if k[0] == "Pod"]


def test_a_planted_pod_that_exited_0_under_the_jobs_name_and_labels_is_not_its_success():
    """Before: the pod, chosen by label, made the job Succeeded at its first reconcile with no
    training (and its /status was read as the chief's progress)."""
    kube = FakeKube(job_obj(workers=2))
    labels = {
        manifests.LABEL_JOB: "mnist",
        manifests.LABEL_ROLE: "worker",
        manifests.LABEL_INDEX: "0",
    }
    fake = planted("Pod", "mnist-worker-0", "team-a", labels=labels)
    kube.objects[("Pod", "mnist-worker-0")] = fake
    kube.set_pod_phase("mnist-worker-0", "Succeeded", exit_code=0)
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.FAILED
    failed = condition(kube, status.FAILED)
    assert failed["reason"] == "ResourceExists"
    assert "Pod team-a/mnist-worker-0 already exists and is not owned" in failed["message"]
    assert "it has no controller" in failed["message"]
    assert not any(c["type"] == status.SUCCEEDED for c in kube.job["status"]["conditions"])
    assert [e.reason for e in d.events] == [
        status.REASON_CREATED,
        "PodCreated",  # worker-1, created alongside before the verdict
        "ResourceExists",
    ]
    assert ("delete", "Pod/mnist-worker-0") not in kube.calls  # not the job's to delete
    # the job's own pod goes with the failed job (cleanPodPolicy Running); the planted one stays
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert sorted(n for k, n in kube.objects if k == "Pod") == ["mnist-worker-0"]
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)  # its counts without the pod
    assert_settled(kube, "team-a", "mnist")


def test_pods_are_the_jobs_by_owner_uid_not_by_name_and_label():
    """The same job's pods, read by a recreated job of the same name (another uid): not its."""
    kube = FakeKube(job_obj(workers=1, uid="old"))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    kube.set_pod_phase("mnist-worker-0", "Succeeded", exit_code=0)
    kube.job = job_obj(workers=1, uid="new")
    with pytest.raises(verdicts.Waiting, match="is going away"):  # the GC removes it: wait
        reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.CREATED  # not Succeeded by the old pod
    kube.objects.clear()  # the garbage collector's turn: the old job's Service, Secret, pod
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    pod = kube.objects[("Pod", "mnist-worker-0")]
    assert manifests.controller_uid(pod) == "new"


def test_an_object_being_deleted_is_waited_for_not_adopted_nor_a_failure():
    kube = FakeKube(job_obj(workers=1))
    kube.objects[("Secret", "mnist-ring-token")] = planted(
        "Secret", "mnist-ring-token", "team-a", {"kind": "Other", "name": "y", "uid": "7"}
    )
    kube.objects[("Secret", "mnist-ring-token")]["metadata"]["deletionTimestamp"] = "2026-01-01"
    with pytest.raises(ApiException, match="going away"):
        reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.CREATED


def test_the_jobs_own_objects_answering_409_are_adopted_as_before():
    """A restarted operator meets its own Service, Secret and pods: read, owned, done."""
    kube = FakeKube(job_obj(workers=2))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    del kube.objects[("Pod", "mnist-worker-1")]
    kube.job["status"] = {}
    kube.calls.clear()
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert ("read", "Secret/mnist-ring-token") in kube.calls
    assert kube.job["status"]["state"] == status.CREATED
    assert [e.message for e in d.events if e.reason == "PodCreated"] == [
        "created pod mnist-worker-1"
    ]


def refused(code: int, reason: str, message: str) -> ApiException:
    e = ApiException(status=code, reason=reason)
    e.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": code})
    return e


def test_a_pod_the_api_server_refuses_with_422_fails_the_job_with_its_message():
    """Before: the job stayed Created, the create retried for ever."""
    said = (
        'Pod "mnist-worker-1" is invalid: spec.containers[0].resources.requests: Invalid '
        'value: "5115Mi": must be less than or equal to memory limit'
    )
    kube = FakeKube(job_obj(workers=2))
    kube.refuse[("Pod", "mnist-worker-1")] = refused(422, "Unprocessable Entity", said)
    d = reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.FAILED
    failed = condition(kube, status.FAILED)
    assert failed["reason"] == status.REASON_CREATE_REFUSED == "CreateRefused"
    assert failed["message"] == (
        "the API server refused to create Pod team-a/mnist-worker-1 (422 Unprocessable "
        f"Entity): {said}"
    )
    assert (d.events[-1].type, d.events[-1].reason) == ("Warning", "CreateRefused")
    assert said in d.events[-1].message
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)  # worker-0 cleaned up
    assert not [k for k in kube.objects if k[0] == "Pod"]
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)  # its counts without the pod
    assert_settled(kube, "team-a", "mnist")


@pytest.mark.parametrize(
    ("code", "reason"),
    [(400, "Bad Request"), (403, "Forbidden"), (404, "Not Found"), (422, "Unprocessable Entity")],
)
def test_every_permanent_refusal_of_a_job_object_is_a_verdict(code, reason):
    kube = FakeKube(job_obj(workers=1))
    kube.refuse[("Service", "mnist")] = refused(code, reason, f"nope {code}")
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    failed = condition(kube, status.FAILED)
    assert failed["reason"] == "CreateRefused" and failed["message"].endswith(f": nope {code}")
    assert not [k for k in kube.objects if k[0] == "Pod"]


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (500, "etcdserver: request timed out"),
        (429, "too many requests"),
        (403, 'pods "mnist-worker-0" is forbidden: exceeded quota: team-a, requested: pods=1'),
    ],
)
def test_a_refusal_that_may_pass_later_is_retried_not_failed(code, message):
    kube = FakeKube(job_obj(workers=1))
    kube.refuse[("Pod", "mnist-worker-0")] = refused(code, "x", message)
    with pytest.raises(ApiException):
        reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert kube.job["status"]["state"] == status.CREATED
    del kube.refuse[("Pod", "mnist-worker-0")]
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert ("Pod", "mnist-worker-0") in kube.objects


def test_the_api_servers_message_is_bounded_and_a_body_without_one_gives_the_status():
    assert verdicts.api_message(json.dumps({"message": "m" * 5000})) == "m" * 999 + "…"
    assert verdicts.api_message("not json", "422 Unprocessable Entity") == (
        "422 Unprocessable Entity"
    )
    obj = {"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}}
    assert verdicts.refusal(obj, 422, "Unprocessable Entity", None).message.endswith(
        "(422 Unprocessable Entity): 422 Unprocessable Entity"
    )
    assert verdicts.refusal(obj, 409, "Conflict", None) is None
    assert verdicts.refusal(obj, 503, "Unavailable", None) is None
    assert verdicts.refusal(obj, None, "", None) is None
