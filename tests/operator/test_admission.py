"""Issue 35, item 4 before anything is created: what the API server would refuse in a job's Pods
(a request above its limit, two mounts at one path) and an sshAuthMountPath sshd would misread
are refused by the spec check — in the operator (Failed/InvalidSpec, one Event, nothing
created), `ringtrain render` and `ringtrain run` alike — naming the field. Before, the pods were
rendered, and the API server's 422 was retried for ever with the job left Created."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from fake_kube import FakeKube
from operator_jobs import job_obj
from test_mpi_job import mpi_job

from ringtrain.errors import InvalidSpec
from ringtrain_localrun.plan import plan
from ringtrain_operator import admission, render, spec, status
from ringtrain_operator.reconcile import reconcile

ROOT = Path(__file__).resolve().parents[2]


def pipelined(depth: int) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "pipelined-model.yaml").read_text())
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["trainer"]["gradientAccumulationSteps"] = depth
    return doc


def refused_everywhere(obj: dict, tmp_path: Path, match: str) -> str:
    """The same refusal from the spec check, `ringtrain render`, `ringtrain run`'s plan and a
    reconcile (Failed/InvalidSpec, one Warning, no object): the message."""
    with pytest.raises(InvalidSpec, match=match) as e:
        admission.load(obj)
    with pytest.raises(InvalidSpec, match=match):
        render.render([copy.deepcopy(obj)])
    with pytest.raises(InvalidSpec, match=match):
        plan(copy.deepcopy(obj), tmp_path)
    meta = obj["metadata"]
    kube = FakeKube({**obj, "metadata": {"namespace": "team-a", "uid": "uid-1", **meta}})
    d = reconcile(kube, kube.job["metadata"]["namespace"], meta["name"], fetch=lambda ip: None)
    assert kube.job["status"]["state"] == status.FAILED
    assert [(ev.type, ev.reason) for ev in d.events] == [("Warning", status.REASON_INVALID)]
    assert kube.objects == {}
    return str(e.value)


def test_a_pipeline_whose_derived_request_outgrows_its_limit_is_refused_naming_the_fields(
    tmp_path,
):
    """examples/pipelined-model.yaml at gradientAccumulationSteps 16: 5115Mi asked, 2263Mi
    limit, because the plan outgrows the IPU: said in the worker's own words, before any pod."""
    admission.load(pipelined(4))  # the example as shipped
    said = refused_everywhere(
        pipelined(16), tmp_path, r"^spec\.trainer: the model does not fit the IPU"
    )
    assert "16 micro-batches in flight" in said and "943,718,400 available" in said
    assert "spec.trainer.gradientAccumulationSteps" in said
    assert "spec.trainer.ipuMemoryMB" in said


@pytest.mark.parametrize(
    ("mpi_spec", "trainer", "field", "volumes"),
    [
        (
            {"sshAuthMountPath": "/checkpoints"},
            {"checkpoint": {"path": "/checkpoints"}},
            "spec.mpi.sshAuthMountPath",
            ("checkpoints", "ssh-auth"),
        ),
        (
            {},
            {"checkpoint": {"path": "/etc/mpi/"}},
            "spec.trainer.checkpoint.path",
            ("checkpoints", "mpi-config"),
        ),
        (
            {"sshAuthMountPath": "/data"},
            {"dataset": "fashion-mnist", "data": {"volume": {"emptyDir": {}}}},
            "spec.mpi.sshAuthMountPath",
            ("data", "ssh-auth"),
        ),
    ],
)
def test_two_volumes_at_one_mount_path_in_an_mpi_job_are_refused_naming_the_field(
    mpi_spec, trainer, field, volumes, tmp_path
):
    obj = mpi_job(mpi_spec=mpi_spec)
    obj["spec"]["trainer"].update(trainer)
    said = refused_everywhere(obj, tmp_path, f"^{field}: ")
    assert f"mountPath of both volume {volumes[0]!r}" in said and f"volume {volumes[1]!r}" in said
    assert "in the Worker pods' container 'ringtrain'" in said


def test_a_templates_mount_on_the_data_path_is_refused_naming_both():
    obj = job_obj(workers=1)
    obj["spec"]["trainer"].update(
        dataset="fashion-mnist", data={"volume": {"emptyDir": {}}, "path": "/in"}
    )
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {
            "containers": [
                {"name": "ringtrain", "volumeMounts": [{"name": "cache", "mountPath": "/in/"}]}
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
        }
    }
    with pytest.raises(InvalidSpec) as e:
        admission.load(obj)
    assert str(e.value).startswith(
        "spec.trainer.data.path: '/in' is the mountPath of both volume 'cache' "
        "(spec.replicaSpecs.Worker.template.spec.containers[0].volumeMounts) and volume 'data' "
        "(spec.trainer.data.path)"
    )


@pytest.mark.parametrize(
    "path", ["/home/u/.ssh\nPermitRootLogin yes", "/home/u/my keys", "/h/%u", "/a\tb", "rel"]
)
def test_an_ssh_auth_mount_path_sshd_would_misread_is_refused_naming_it(path, tmp_path):
    """Before: a newline wrote directives into sshd_config (the CRD checked only ``^/``)."""
    said = refused_everywhere(
        mpi_job(mpi_spec={"sshAuthMountPath": path}), tmp_path, r"^spec\.mpi\.sshAuthMountPath: "
    )
    assert "does not match" in said


def test_the_crds_pattern_for_ssh_auth_mount_path_is_the_one_applied():
    mpi_props = spec.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]["properties"]["mpi"]["properties"]
    assert mpi_props["sshAuthMountPath"]["pattern"] == "^/[-A-Za-z0-9._~+@,:=/]*$"
    spec.load(mpi_job(mpi_spec={"sshAuthMountPath": "/root/.ssh"}))
