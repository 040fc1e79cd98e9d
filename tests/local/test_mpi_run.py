"""MPI jobs (spec.mpi) under `ringtrain run`: a real `mpirun` (Debian's Open MPI) starts the
ranks on this host from the launcher's pod, the workers' sshd stood in for by idle processes
(issue 21). The built-in trainer over MPI must end with the ring job's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.procs import CLI, ringtrain

from ringtrain_localrun import plan
from ringtrain_operator import mpirun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.mpi


def run_json(manifest: Path, run_dir: Path) -> tuple[dict, str]:
    out = ringtrain("run", "--json", "--run-dir", str(run_dir), str(manifest), timeout_s=240)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    final = [d for d in lines if d.get("event") == "final"]
    assert final, out.stderr[-3000:]
    assert (final[-1]["phase"], out.returncode) == ("Succeeded", 0), out.stderr[-3000:]
    return final[-1], out.stderr


def weights(checkpoint: str) -> dict[str, np.ndarray]:
    with np.load(Path(checkpoint).with_suffix(".npz")) as z:
        return {k: z[k] for k in z.files}


def test_the_horovod_style_example_ends_with_the_ring_jobs_weights(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text())
    mpi_file = tmp_path / "mpi.yaml"
    mpi_file.write_text(yaml.safe_dump(doc))
    ring = {**doc, "metadata": {"name": "ring"}}
    ring["spec"] = {k: v for k, v in doc["spec"].items() if k != "mpi"}
    ring["spec"]["replicaSpecs"] = {"Worker": doc["spec"]["replicaSpecs"]["Worker"]}
    ring_file = tmp_path / "ring.yaml"
    ring_file.write_text(yaml.safe_dump(ring))

    by_mpi, stderr = run_json(mpi_file, tmp_path / "mpi")
    by_ring, _ = run_json(ring_file, tmp_path / "ring")
    assert by_mpi["exit_codes"] == {"worker-0": 0, "worker-1": 0, "launcher-0": 0}
    assert by_mpi["steps"] == by_ring["steps"] == doc["spec"]["trainer"]["steps"]
    a, b = weights(by_mpi["checkpoint"]), weights(by_ring["checkpoint"])
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # rank 0 checkpointed into the run's checkpoint volume, as on worker 0's in a cluster
    assert Path(by_mpi["checkpoint"]).is_relative_to(tmp_path / "mpi" / "checkpoints")
    assert "PRIVATE KEY" not in stderr


def test_a_stock_mpi4py_script_job_allreduces_across_every_rank(tmp_path):
    final, stderr = run_json(EXAMPLES / "mpi4py-allreduce.yaml", tmp_path / "run")
    assert final["exit_codes"]["launcher-0"] == 0
    for rank in range(4):  # 2 workers x slotsPerWorker 2
        assert f"rank {rank}/4:" in stderr and "WRONG" not in stderr


def test_locally_the_hostfile_is_this_host_and_the_key_a_file_of_the_run(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "mpi4py-allreduce.yaml").read_text())
    _, replicas = plan.plan(doc, tmp_path)
    launcher = next(r for r in replicas if r.role == "launcher")
    hostfile = launcher.env["OMPI_MCA_orte_default_hostfile"]
    assert Path(hostfile).is_relative_to(tmp_path)
    assert launcher.files[hostfile] == b"localhost slots=4\n"
    assert launcher.argv[1:5] == (
        "-m",
        "ringtrain_operator.mpilaunch",
        "--no-termination-log",
        "mpirun",
    )
    assert launcher.argv[launcher.argv.index("-np") + 1] == "4"
    assert not any(k.startswith("OMPI_MCA_btl_tcp_port") for k in launcher.env)
    keys = [p for p in launcher.files if p.endswith(mpirun.KEY_FILE)]
    assert len(keys) == 1 and b"PRIVATE KEY" in launcher.files[keys[0]]
    workers = [r for r in replicas if r.role == "worker"]
    assert [r.argv for r in workers] == [plan.SSHD_STAND_IN] * 2
    assert all(r.metrics_port is None for r in workers)


@pytest.mark.parametrize("command", ["render", "run"])
@pytest.mark.parametrize(
    ("replica_specs", "field"),
    [
        ({"Evaluator": {"replicas": 1}}, "spec.replicaSpecs.Evaluator"),
        ({"PS": {"replicas": 1}}, "spec.replicaSpecs.PS"),
        ({"Worker": {"replicas": 0}}, "spec.replicaSpecs.Worker.replicas"),
        (
            {
                "Launcher": {
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ringtrain",
                                    "resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}},
                                }
                            ]
                        }
                    }
                }
            },
            "spec.replicaSpecs.Launcher.template.spec.containers[0].resources.requests.cpu",
        ),
        (
            {
                "Launcher": {
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ringtrain",
                                    "resources": {"requests": {"memory": "100Ti"}},
                                }
                            ]
                        }
                    }
                }
            },
            "spec.replicaSpecs.Launcher.template.spec.containers[0].resources.requests.memory",
        ),
    ],
)
def test_the_clis_refuse_an_mpi_job_that_cannot_run_naming_the_field(
    tmp_path, command, replica_specs, field
):
    doc = yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text())
    doc["spec"]["replicaSpecs"] = {**doc["spec"]["replicaSpecs"], **replica_specs}
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    args = ["--run-dir", str(tmp_path / "run")] if command == "run" else []
    out = ringtrain(command, *args, str(manifest), timeout_s=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert field in out.stderr
    assert not (tmp_path / "run").exists()


#: long enough that rank 1 is still training when the kill lands, on a loaded machine
KILL_STEPS, KILL_CHECKPOINT_EVERY = 200, 5


def kill_job(tmp_path: Path) -> dict:
    doc = yaml.safe_load((EXAMPLES / "mpi-horovod-style.yaml").read_text())
    doc["metadata"]["name"] = "resume"
    doc["spec"]["trainer"].update(
        steps=KILL_STEPS, batchSize=64, checkpoint={"everySteps": KILL_CHECKPOINT_EVERY}
    )
    doc["spec"]["runPolicy"] = {"backoffLimit": 3}
    return doc


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of MPI rank ``rank`` among the launcher's descendants (mpirun's children), by
    the ``OMPI_COMM_WORLD_RANK`` Open MPI gives each rank."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, mark = list(children.get(launcher, [])), f"OMPI_COMM_WORLD_RANK={rank}".encode()
    while todo:
        pid = todo.pop()
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            return pid
        todo += children.get(pid, [])
    return None


@pytest.mark.slow
def test_a_rank_killed_mid_run_restarts_the_launcher_and_resumes_from_the_checkpoint(tmp_path):
    """SIGKILL rank 1 once rank 0 has checkpointed: mpirun fails, the launcher (OnFailure)
    restarts in place, rank 0 resumes from the newest checkpoint and the job ends Succeeded
    with the undisturbed run's weights."""
    manifest = tmp_path / "resume.yaml"
    manifest.write_text(yaml.safe_dump(kill_job(tmp_path)))
    run_dir = tmp_path / "run"
    argv = [*CLI, "run", str(manifest), "--json", "--run-dir", str(run_dir)]
    with (
        open(tmp_path / "replicas.log", "w") as logs,
        subprocess.Popen(
            [*argv, "--progress-interval", "0", "--grace-period", "5"],
            stdout=subprocess.PIPE,
            stderr=logs,
            text=True,
        ) as p,
    ):
        events, launcher, killed_at = [], None, None
        for line in p.stdout:
            events.append(e := json.loads(line))
            if e["event"] == "started" and e["replica"] == "launcher-0" and launcher is None:
                launcher = e["pid"]
            if launcher is not None and killed_at is None:
                saved = sorted((run_dir / "checkpoints").glob("ckpt-*.json"))
                if saved and (pid := rank_pid(launcher, 1)) is not None:
                    killed_at = json.loads(saved[-1].read_text())["step"]
                    os.kill(pid, signal.SIGKILL)
        p.wait(timeout=240)
    log = (tmp_path / "replicas.log").read_text()
    assert killed_at is not None and killed_at < KILL_STEPS, log[-3000:]
    final = events[-1]
    assert (final["phase"], final["steps"], p.returncode) == ("Succeeded", KILL_STEPS, 0), log[
        -3000:
    ]
    restarting = [e for e in events if e.get("reason") == "TrainingJobRestarting"]
    assert restarting and all(
        "pod resume-launcher failed" in e["message"]
        and "mpirun starts every rank again from the last checkpoint" in e["message"]
        for e in restarting
    )
    assert final["restarts"] >= 1
    started = [e["replica"] for e in events if e["event"] == "started"]
    assert started.count("launcher-0") == 1 + final["restarts"], "the launcher restarted in place"
    assert started.count("worker-0") == started.count("worker-1") == 1
    # rank 0 started once per launcher run; its first progress after the restart is past the
    # checkpoint (a run from scratch reports step 1)
    # (the launcher shows rank 0's lines, stderr's too, as they are; other ranks' prefixed)
    assert log.count("launcher-0| ringtrain worker: optimizer ") == 1 + final["restarts"]
    again = max(
        i for i, e in enumerate(events) if e["event"] == "started" and e["replica"] == "launcher-0"
    )
    before = [e["step"] for e in events[:again] if e["event"] == "progress" and e["step"]]
    stale = before[-1] if before else None
    resumed = [
        e["step"]
        for e in events[again:]
        if e["event"] == "progress" and e["step"] and e["step"] != stale
    ]
    assert resumed and resumed[0] > killed_at >= KILL_CHECKPOINT_EVERY, (before, resumed)
    assert final["exit_codes"]["launcher-0"] == 0

    undisturbed = tmp_path / "undisturbed.yaml"
    undisturbed.write_text(yaml.safe_dump(kill_job(tmp_path)))
    by_one_run, _ = run_json(undisturbed, tmp_path / "undisturbed")
    a, b = weights(final["checkpoint"]), weights(by_one_run["checkpoint"])
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
