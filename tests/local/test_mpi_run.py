"""MPI jobs (spec.mpi) under `ringtrain run`: a real `mpirun` (Debian's Open MPI) starts the
ranks on this host from the launcher's pod, the workers' sshd stood in for by idle processes
(issue 21). The built-in trainer over MPI must end with the ring job's weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.procs import ringtrain

from ringtrain_localrun import plan
from ringtrain_operator import mpi

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
    keys = [p for p in launcher.files if p.endswith(mpi.KEY_FILE)]
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
