"""MPI jobs (spec.mpi): the objects, the refusals, the launcher's readiness gate and the fold's
verdicts, all as pure functions of the spec (issue 21); the real mpirun runs in
tests/local/test_mpi_run.py."""

from __future__ import annotations

import base64
import copy
import json
import os
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import serialization
from fake_kube import FakeKube

from ringtrain.errors import InvalidSpec
from ringtrain_operator import (
    lifecycle,
    manifests,
    mpi,
    mpirun,
    networkpolicy,
    reconcile,
    render,
    scanskips,
    status,
)
from ringtrain_operator import spec as jobspec
from ringtrain_operator.observe import ObservedPod

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def mpi_job(workers: int = 2, mpi_spec: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": jobspec.API_VERSION,
        "kind": jobspec.KIND,
        "metadata": {"name": "hvd", "namespace": "team", "uid": "u-1"},
        "spec": {
            "mpi": mpi_spec if mpi_spec is not None else {},
            "replicaSpecs": {"Worker": {"replicas": workers}},
            "trainer": {"dataset": "mnist-5k", "steps": 4},
            **spec,
        },
    }


def load(obj: dict) -> jobspec.Job:
    return jobspec.load(obj)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def main(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


def test_defaults_are_mpi_operators_and_the_launcher_is_added():
    job = load(mpi_job())
    assert job.mpi == jobspec.MPISpec(
        "OpenMPI", 1, "WaitForWorkersReady", "/home/ringtrain/.ssh", None
    )
    launcher = job.replica("launcher")
    assert launcher is not None and launcher.restart_policy == "OnFailure"
    assert [job.pod_name(r.role, i) for r, i in job.members()] == [
        "hvd-worker-0",
        "hvd-worker-1",
        "hvd-launcher",
    ]


def test_every_object_of_the_job_with_the_hostfile_and_the_ssh_secret():
    job = load(mpi_job(mpi_spec={"slotsPerWorker": 2}))
    objs = mpi.desired_objects(job)
    assert [o["kind"] for o in objs] == ["Service", "Secret", "ConfigMap", "Pod", "Pod", "Pod"]
    for o in objs:  # every child is owned: the garbage collector deletes it with the job
        assert o["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    (svc,) = by_kind(objs, "Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [mpirun.SSHD_PORT]
    (secret,) = by_kind(objs, "Secret")
    assert secret["type"] == "kubernetes.io/ssh-auth"
    assert set(secret["data"]) == {"ssh-privatekey", "ssh-publickey"}
    (cm,) = by_kind(objs, "ConfigMap")
    assert cm["data"]["hostfile"] == (
        "hvd-worker-0.hvd.team.svc slots=2\nhvd-worker-1.hvd.team.svc slots=2\n"
    )
    assert f"Port {mpirun.SSHD_PORT}" in cm["data"]["sshd_config"]
    assert "PasswordAuthentication no" in cm["data"]["sshd_config"]
    assert "AuthorizedKeysFile /home/ringtrain/.ssh/authorized_keys" in cm["data"]["sshd_config"]


def test_the_key_pair_is_fresh_per_job_valid_and_its_public_half_is_the_authorized_key():
    job = load(mpi_job())
    a, b = mpi.ssh_secret(job), mpi.ssh_secret(job)
    pa, pb = (base64.b64decode(s["data"]["ssh-privatekey"]) for s in (a, b))
    assert pa != pb
    key = serialization.load_ssh_private_key(pa, password=None)
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    assert base64.b64decode(a["data"]["ssh-publickey"]).strip() == public
    # another job's workers authorise only their own key: its public key is not this one
    assert base64.b64decode(b["data"]["ssh-publickey"]).strip() != public


def test_render_shows_every_object_and_no_key():
    objs = render.render([mpi_job()])
    kinds = ["Service", "Secret", "ConfigMap", "Pod", "Pod", "Pod", "NetworkPolicy"]
    assert [o["kind"] for o in objs] == kinds
    (policy,) = by_kind(objs, "NetworkPolicy")
    assert {"protocol": "TCP", "port": mpirun.SSHD_PORT} in policy["spec"]["ingress"][0]["ports"]
    (secret,) = by_kind(objs, "Secret")
    assert set(secret["data"].values()) == {render.REDACTED}
    assert "PRIVATE KEY" not in render.dump(objs)


def test_workers_run_sshd_non_root_unprivileged_read_only_and_are_ready_when_it_answers():
    job = load(mpi_job())
    pod = mpi.pod(job, job.replica("worker"), 1)
    c = main(pod)
    assert c["command"][-1].endswith(f"exec /usr/sbin/sshd -D -e -f {mpi.SSHD_CONFIG}")
    assert mpirun.SSHD_PORT >= 1024
    assert {"containerPort": mpirun.SSHD_PORT, "name": "ssh", "protocol": "TCP"} in c["ports"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    psc = pod["spec"]["securityContext"]
    assert psc["runAsNonRoot"] and psc["runAsUser"] == manifests.RUN_AS_USER
    assert c["readinessProbe"]["tcpSocket"] == {"port": mpirun.SSHD_PORT}
    assert c["livenessProbe"]["tcpSocket"] == {"port": mpirun.SSHD_PORT} and "args" not in c
    # no ring: no TF_CONFIG, no ring token, no ring ports
    assert not {e["name"] for e in c["env"]} & {"TF_CONFIG", "RINGTRAIN_TOKEN_FILE"}
    assert {p["name"] for p in c["ports"]} == {"ssh", "metrics"}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "ring-token" not in volumes
    assert volumes[mpi.SSH_VOLUME]["secret"]["defaultMode"] == 0o400
    assert volumes[mpi.SSHD_VOLUME] == {"name": mpi.SSHD_VOLUME, "emptyDir": {"medium": "Memory"}}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/home/ringtrain/.ssh"]["readOnly"] and mounts[mpi.SSHD_RUN_DIR]
    assert mounts["/checkpoints"]["name"] == manifests.CHECKPOINT_VOLUME  # rank 0 writes here


def test_a_templates_own_scanner_skips_stay_and_the_launchers_take_the_free_numbers():
    """Issue 35: the launcher's probe exceptions are annotations on the pod; a template's own
    (the stock MPI example carries skip1 and skip2 for the same checks) are never overwritten."""
    own = {"checkov.io/skip1": "CKV_K8S_8=mine", "checkov.io/skip3": "CKV_K8S_20=other"}
    got = scanskips.with_skips({**own, "team": "a"}, scanskips.LAUNCHER)
    assert got == {
        **own,
        "team": "a",
        "checkov.io/skip2": "CKV_K8S_9=" + scanskips.LAUNCHER["CKV_K8S_9"],
    }
    assert scanskips.with_skips(got, scanskips.LAUNCHER) == got


def test_the_launcher_runs_mpirun_with_the_trainer_over_mpi_and_openmpis_settings():
    job = load(mpi_job(mpi_spec={"slotsPerWorker": 1}, trainer={"steps": 4, "seed": 3}))
    pod = mpi.pod(job, job.replica("launcher"), 0)
    assert pod["metadata"]["name"] == "hvd-launcher"
    # no scrape annotations (it serves no metrics); its scanner exceptions, with their reasons
    assert pod["metadata"]["annotations"] == {
        f"checkov.io/skip{n}": f"{check}={why}"
        for n, (check, why) in enumerate(scanskips.LAUNCHER.items(), 1)
    }
    c = main(pod)
    launch, command = c["command"][:3], c["command"][3:]
    assert launch == list(mpirun.LAUNCH) and command[:3] == ["mpirun", "-np", "2"]
    program = command[command.index("ringtrain") :]
    assert program[:4] == ["ringtrain", "worker", "--collective", "mpi"]
    assert program[4:] == manifests.trainer_args(job.trainer)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["OMPI_MCA_orte_default_hostfile"] == mpirun.HOSTFILE
    assert (
        f"-p {mpirun.SSHD_PORT} -i /home/ringtrain/.ssh/id_ed25519" in env["OMPI_MCA_plm_rsh_args"]
    )
    assert "TF_CONFIG" not in env and "ports" not in c and "readinessProbe" not in c
    names = {v["name"] for v in pod["spec"]["volumes"]}
    assert manifests.CHECKPOINT_VOLUME not in names and mpi.SSH_VOLUME in names


def test_a_stock_script_runs_under_mpirun_with_slots_and_no_trainer():
    obj = mpi_job(workers=3, mpi_spec={"slotsPerWorker": 2, "command": ["python3", "/app/a.py"]})
    del obj["spec"]["trainer"]
    template = {"spec": {"containers": [{"name": "main", "image": "my/mpi4py:1"}]}}
    obj["spec"]["replicaSpecs"] = {
        "Worker": {"replicas": 3, "template": template},
        "Launcher": {"template": copy.deepcopy(template)},
    }
    job = load(obj)
    c = main(mpi.pod(job, job.replica("launcher"), 0))
    assert c["image"] == "my/mpi4py:1"
    assert c["command"][:3] == ["mpirun", "-np", "6"]
    assert c["command"][-2:] == ["python3", "/app/a.py"]
    # a launcher template with its own mpirun line runs as written (mpi-operator's way)
    obj["spec"]["mpi"] = {}
    obj["spec"]["replicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"] = [
        "mpirun",
        "python3",
        "/app/a.py",
    ]
    job = load(obj)
    assert main(mpi.pod(job, job.replica("launcher"), 0))["command"] == [
        "mpirun",
        "python3",
        "/app/a.py",
    ]


def resources(**by_name: tuple[str | None, str | None]) -> dict:
    """A template whose main container asks for (request, limit) of each resource."""
    asked: dict[str, dict] = {"requests": {}, "limits": {}}
    for name, (request, limit) in by_name.items():
        for kind, value in (("requests", request), ("limits", limit)):
            if value is not None:
                asked[kind][name] = value
    return {"spec": {"containers": [{"name": "ringtrain", "resources": asked}]}}


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s["replicaSpecs"].update(Evaluator={"replicas": 1}), "Evaluator"),
        (lambda s: s["replicaSpecs"].update(PS={"replicas": 1}), "PS"),
        (lambda s: s["replicaSpecs"].update(Chief={"replicas": 1}), "Chief"),
        (lambda s: s["replicaSpecs"]["Worker"].update(replicas=0), "Worker.replicas"),
        (lambda s: s["mpi"].update(command=["python3", "a.py"]), "spec.mpi.command"),
        (lambda s: s["mpi"].update(slotsPerWorker=0), "spec.mpi.slotsPerWorker"),
        (lambda s: s["mpi"].update(mpiImplementation="MPICH"), "spec.mpi.mpiImplementation"),
        (lambda s: s["mpi"].update(launcherCreationPolicy="Later"), "launcherCreationPolicy"),
        (lambda s: s["runPolicy"].update(successPolicy="AllWorkers"), "successPolicy"),
        (
            lambda s: s["replicaSpecs"]["Worker"].update(
                template={"spec": {"containers": [{"name": "ringtrain", "command": ["x"]}]}}
            ),
            "Worker.template.spec.containers[].command",
        ),
        (lambda s: s.pop("mpi"), "spec.replicaSpecs.Launcher"),
        (
            lambda s: s["replicaSpecs"]["Launcher"].update(template=resources(cpu=("4", "2"))),
            "Launcher.template.spec.containers[0].resources.requests.cpu",
        ),
        (
            lambda s: s["replicaSpecs"]["Launcher"].update(
                template=resources(memory=("100Ti", None))
            ),
            "Launcher.template.spec.containers[0].resources.requests.memory",
        ),
        (
            lambda s: s["replicaSpecs"]["Launcher"].update(template=resources(cpu=("-1", None))),
            "Launcher.template.spec.containers[0].resources.requests.cpu",
        ),
        (
            lambda s: s["replicaSpecs"]["Worker"].update(template=resources(memory=(None, "1Q"))),
            "Worker.template.spec.containers[0].resources.limits.memory",
        ),
    ],
)
def test_specs_that_cannot_run_are_refused_naming_the_field(edit, field):
    obj = mpi_job()
    obj["spec"]["runPolicy"] = {}
    obj["spec"]["replicaSpecs"]["Launcher"] = {"replicas": 1}
    edit(obj["spec"])
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.").replace("[", r"\[")):
        load(obj)


def test_resources_that_can_schedule_are_kept():
    obj = mpi_job()
    obj["spec"]["replicaSpecs"]["Launcher"] = {
        "template": resources(cpu=("500m", "1"), memory=("1Gi", "1Gi"))
    }
    launcher = next(p for p in mpi.pods(load(obj)) if "launcher" in p["metadata"]["name"])
    assert main(launcher)["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }


def test_a_stock_mpi_job_needs_a_command():
    obj = mpi_job()
    del obj["spec"]["trainer"]
    template = {"spec": {"containers": [{"name": "main", "image": "my/mpi4py:1"}]}}
    obj["spec"]["replicaSpecs"] = {"Worker": {"replicas": 1, "template": template}}
    obj["spec"]["replicaSpecs"]["Launcher"] = {"template": template}
    with pytest.raises(InvalidSpec, match=r"spec\.mpi\.command: required"):
        load(obj)


def observed(name: str, role: str, index: int, **kw) -> ObservedPod:
    return ObservedPod(name=name, role=role, index=index, **kw)


def workers_up(ready: bool = True) -> list[ObservedPod]:
    return [observed(f"hvd-worker-{i}", "worker", i, phase="Running", ready=ready) for i in (0, 1)]


def test_the_launcher_waits_for_every_workers_sshd_and_status_names_the_wait():
    job = load(mpi_job())
    d = lifecycle.derive_status(job, [], T0, {})
    assert d.create == ("hvd-worker-0", "hvd-worker-1")
    pods = workers_up(ready=False)[:1] + workers_up()[1:]
    d = lifecycle.derive_status(job, pods, T0, d.status)
    assert d.create == ()
    (created,) = [c for c in d.status["conditions"] if c["type"] == status.CREATED]
    assert created["reason"] == mpi.REASON_WAITING and "hvd-worker-0" in created["message"]
    assert "hvd-worker-1" not in created["message"]
    d = lifecycle.derive_status(job, workers_up(), T0, d.status)
    assert d.create == ("hvd-launcher",)


def test_at_startup_creates_the_launcher_with_the_workers():
    job = load(mpi_job(mpi_spec={"launcherCreationPolicy": "AtStartup"}))
    d = lifecycle.derive_status(job, [], T0, {})
    assert d.create == ("hvd-worker-0", "hvd-worker-1", "hvd-launcher")


def test_the_jobs_outcome_is_the_launchers_and_the_running_workers_are_cleaned_up():
    job = load(mpi_job())
    launcher = observed("hvd-launcher", "launcher", 0, phase="Running", ready=True)
    d = lifecycle.derive_status(job, [*workers_up(), launcher], T0, {})
    assert d.status["state"] == status.RUNNING
    final = json.dumps({"event": "final", "steps": 4, "loss": 0.25, "terminated": False})
    done = observed(
        "hvd-launcher", "launcher", 0, phase="Succeeded", exit_code=0, termination_message=final
    )
    d = lifecycle.derive_status(job, [*workers_up(), done], T0, d.status)
    assert d.status["state"] == status.SUCCEEDED
    assert d.status["progress"]["step"] == 4  # rank 0's result, kept by the launcher
    assert set(d.delete) == {"hvd-worker-0", "hvd-worker-1"}  # cleanPodPolicy Running


def test_a_failed_mpirun_restarts_the_launcher_in_place_then_backoff_fails_the_job():
    obj = mpi_job(runPolicy={"backoffLimit": 1})
    job = load(obj)
    up = observed("hvd-launcher", "launcher", 0, phase="Running", ready=True)
    d = lifecycle.derive_status(job, [*workers_up(), up], T0, {})
    # mpirun exits 1 when a worker's ranks are lost: OnFailure restarts it in place
    failed = observed("hvd-launcher", "launcher", 0, phase="Running", exit_code=1, restarting=True)
    d = lifecycle.derive_status(job, [*workers_up(), failed], T0, d.status)
    assert d.status["state"] == status.RESTARTING and d.status["restarts"] == 1
    (restarting,) = [c for c in d.status["conditions"] if c["type"] == status.RESTARTING]
    assert restarting["message"] == (
        "pod hvd-launcher failed with exit code 1: restarting in place, mpirun starts every "
        "rank again from the last checkpoint (restart 1 of 1)"
    )
    again = observed(
        "hvd-launcher", "launcher", 0, phase="Running", exit_code=1, restarting=True, restarts=1
    )
    d = lifecycle.derive_status(job, [*workers_up(), again], T0, d.status)
    assert d.status["state"] == status.FAILED
    assert "BackoffLimitExceeded" in [c["reason"] for c in d.status["conditions"]]


def test_a_running_mpi_job_whose_spec_mpi_was_pruned_fails_naming_it():
    """An older CRD re-applied prunes spec.mpi and the Launcher from the stored job: what is
    left reads as a ring job of the same workers, which would run sshd for ever. Its launcher
    pod gives it away: the job fails, naming spec.mpi, and its running pods are cleaned up."""
    launcher = observed("hvd-launcher", "launcher", 0, phase="Running", ready=True)
    d = lifecycle.derive_status(load(mpi_job()), [*workers_up(), launcher], T0, {})
    assert d.status["state"] == status.RUNNING
    pruned = mpi_job()
    del pruned["spec"]["mpi"]
    d = lifecycle.derive_status(load(pruned), [*workers_up(), launcher], T0, d.status)
    assert d.status["state"] == status.FAILED
    (failed,) = [c for c in d.status["conditions"] if c["type"] == status.FAILED]
    assert failed["reason"] == status.REASON_INVALID
    assert failed["message"].startswith("spec.mpi: missing, but pod hvd-launcher is")
    assert [(e.type, e.reason) for e in d.events] == [("Warning", status.REASON_INVALID)]
    assert set(d.delete) == {"hvd-worker-0", "hvd-worker-1", "hvd-launcher"}
    # a ring job of the same name and workers, without a launcher, runs on
    ring = lifecycle.derive_status(load(pruned), workers_up(), T0, {})
    assert ring.status["state"] != status.FAILED


def test_reconcile_creates_the_ssh_secret_and_hostfile_then_the_launcher_once_ready():
    kube = FakeKube(mpi_job())
    reconcile.reconcile(kube, "team", "hvd", now=T0, fetch=lambda ip: None)
    assert ("create", "Secret/hvd-ssh") in kube.calls
    assert ("create", "ConfigMap/hvd-mpi") in kube.calls
    assert ("create", "Secret/hvd-ring-token") not in kube.calls
    assert ("Pod", "hvd-launcher") not in kube.objects
    for i in (0, 1):
        kube.set_pod_phase(f"hvd-worker-{i}", "Running")
    reconcile.reconcile(kube, "team", "hvd", now=T0, fetch=lambda ip: None)
    assert ("Pod", "hvd-launcher") in kube.objects
    # the key is in the Secret only: not in the status the operator wrote
    key = kube.objects[("Secret", "hvd-ssh")]["data"]["ssh-privatekey"]
    assert key not in repr(kube.job["status"])


@pytest.mark.parametrize(
    ("replica_specs", "field"),
    [
        (
            {"Launcher": {"template": resources(cpu=("8", "1"))}},
            "spec.replicaSpecs.Launcher.template.spec.containers[0].resources.requests.cpu",
        ),
        (
            {"Launcher": {"template": resources(memory=("100Ti", None))}},
            "spec.replicaSpecs.Launcher.template.spec.containers[0].resources.requests.memory",
        ),
        ({"Evaluator": {"replicas": 1}}, "spec.replicaSpecs.Evaluator"),
        ({"PS": {"replicas": 1}}, "spec.replicaSpecs.PS"),
        ({"Worker": {"replicas": 0}}, "spec.replicaSpecs.Worker.replicas"),
    ],
)
def test_the_operator_fails_an_mpi_job_that_cannot_run_naming_the_field(replica_specs, field):
    obj = mpi_job()
    obj["spec"]["replicaSpecs"].update(replica_specs)
    kube = FakeKube(obj)
    result = reconcile.reconcile(kube, "team", "hvd", now=T0, fetch=lambda ip: None)
    assert kube.job["status"]["state"] == status.FAILED
    assert field in repr(kube.job["status"])
    assert [(e.type, e.reason) for e in result.events] == [("Warning", status.REASON_INVALID)]
    assert field in result.events[0].message
    assert kube.objects == {}  # no pod, Secret or ConfigMap


def test_network_policy_sshd_only_from_the_launcher_mpi_ports_only_within_the_job():
    job = load(mpi_job())
    policy = mpi.network_policy(job, networkpolicy.Settings())
    rules = policy["spec"]["ingress"]
    ssh = [r for r in rules if {"protocol": "TCP", "port": mpirun.SSHD_PORT} in r["ports"]]
    assert len(ssh) == 1
    assert ssh[0]["from"] == [
        {"podSelector": {"matchLabels": manifests.labels(job, "launcher", 0)}}
    ]
    (between,) = [r for r in rules if any(p.get("endPort") for p in r["ports"])]
    assert between["from"] == [{"podSelector": {"matchLabels": manifests.labels(job)}}]
    assert {p["port"] for p in between["ports"]} == {mpirun.BTL_PORT_MIN, mpirun.OOB_PORT_MIN}
    # nothing else may reach the job's pods but the ring policy's metrics rule
    others = [r for r in rules if r not in ssh and r is not between]
    assert all(p["port"] == manifests.METRICS_PORT for r in others for p in r["ports"])


def test_the_launcher_keeps_rank_0s_final_event_as_its_termination_message(tmp_path):
    """mpilaunch runs a real mpirun (--tag-output): rank 1's final event does not count."""
    import sys

    from ringtrain_operator import mpilaunch

    code = (
        "import json, os; r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
        "print(json.dumps({'event': 'final', 'steps': 5 + r, 'loss': 0.5, 'terminated': False}))"
    )
    log = tmp_path / "termination-log"
    mpirun = ["mpirun", "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    assert mpilaunch.main([*mpirun, "-np", "2", sys.executable, "-c", code], str(log)) == 0
    assert json.loads(log.read_text())["steps"] == 5
    assert mpilaunch.main([*mpirun, "-np", "1", "false"], str(log)) == 1
    assert mpilaunch.rank0_final("[3,1]<stdout>:{}") is None
    # the log: rank 0 as it is, other ranks' log lines named, their events dropped
    assert mpilaunch.shown("[3,0]<stdout>:hello") == "hello"
    assert mpilaunch.shown("[3,1]<stdout>:hello") == "[rank 1] hello"
    assert mpilaunch.shown('[3,1]<stdout>:{"event": "final", "steps": 1}') is None


def test_a_final_event_written_in_two_chunks_is_still_rank_0s_final():
    """Open MPI tags every chunk a rank writes: a line whose newline (or middle) came in its own
    write reads ``[1,0]<stdout>:{...}[1,0]<stdout>:`` — seen in a loaded CI run, where the MPI
    job Succeeded with no progress in its status."""
    from ringtrain_operator import mpilaunch

    event = '{"event": "final", "steps": 20, "loss": 0.5, "terminated": false}'
    for line in (
        f"[1,0]<stdout>:{event}[1,0]<stdout>:",
        f"[1,0]<stdout>:{event[:17]}[1,0]<stdout>:{event[17:]}",
    ):
        final = mpilaunch.rank0_final(line)
        assert final is not None and final.steps == 20, line
    assert mpilaunch.untag("[1,0]<stderr>:warning[1,0]<stderr>:") == (0, "warning")


def test_rank_0s_final_event_split_by_rank_1s_line_is_reassembled():
    """Both ranks write their final line at once: rank 1's whole line can come between the two
    halves of rank 0's, on mpirun's output as two lines (a loaded cluster's MPI job Succeeded
    with its status stuck at rank 0's last live step, 17 of 20)."""
    from ringtrain_operator import mpilaunch

    event = '{"event": "final", "steps": 20, "loss": 0.5, "terminated": false}'
    other = '{"event": "final", "steps": 20, "loss": 0.5, "terminated": false, "rank": 1}'
    lines = mpilaunch.Lines()
    assert lines.feed(f"[1,0]<stdout>:{event[:17]}[1,1]<stdout>:{other}") == [(1, other)]
    assert lines.feed(f"[1,0]<stdout>:{event[17:]}") == [(0, event)]
    final = mpilaunch.final_of(0, event)
    assert final is not None and final.steps == 20
    assert lines.feed("mpirun: a line of its own") == [(None, "mpirun: a line of its own")]
    # a rank's stdout and stderr are separate lines
    lines.feed("[1,0]<stderr>:warn[1,0]<stdout>:out")
    assert lines.feed("[1,0]<stderr>:ing") == [(0, "warning")]


def test_a_ranks_stray_non_utf8_byte_is_shown_replaced_not_a_launcher_traceback(tmp_path, capsys):
    """Before (issue 35): one byte that is not UTF-8 from any rank crashed the launcher with a
    UnicodeDecodeError traceback, and the job's result was lost."""
    import sys

    from ringtrain_operator import mpilaunch

    code = (
        "import json, os, sys; r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
        "sys.stdout.buffer.write(b'bad \\xff byte\\n'); sys.stdout.flush(); "
        "print(json.dumps({'event': 'final', 'steps': 3, 'loss': 0.5, 'terminated': False}))"
    )
    log = tmp_path / "termination-log"
    mpirun = ["mpirun", "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    assert mpilaunch.main([*mpirun, "-np", "2", sys.executable, "-c", code], str(log)) == 0
    assert json.loads(log.read_text())["steps"] == 3
    out = capsys.readouterr().out
    assert "bad \ufffd byte" in out and "[rank 1] bad \ufffd byte" in out


def test_a_rank_mpirun_cannot_start_is_a_permanent_failure_in_mpiruns_words(tmp_path):
    """Before (issue 34): mpirun's 'could not access or execute' exits 132, which the restart
    policy reads as transient, so a wrong command line was retried six times."""
    from ringtrain.errors import EXIT_PERMANENT
    from ringtrain_operator import mpilaunch

    log = tmp_path / "termination-log"
    mpirun = ["mpirun", "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    assert mpilaunch.main([*mpirun, "-np", "1", "/nonexistent/prog"], str(log)) == EXIT_PERMANENT
    message = log.read_text()
    assert message.startswith("mpirun could not start the job's ranks: mpirun was unable to")
    assert "/nonexistent/prog" in message and len(message) < 600
