"""`ringtrain run`'s plan on paths (issue 34): a pod's volumes are made local without touching
the user's own paths — a model or a checkout under /tmp, the interpreter of an MPI launcher —
and a missing model names the path looked up and why (docs/decisions/0200-local-run-paths.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_local_run import ROOT, command_job, run, tiny_job, write

from ringtrain_localrun import plan
from ringtrain_operator import spec as jobspec


def arg(replica: plan.Replica, flag: str) -> str:
    argv = list(replica.argv)
    return argv[argv.index(flag) + 1]


def test_a_user_model_under_tmp_is_passed_as_written(tmp_path):
    model = tmp_path / "me" / "my_model.keras"  # pytest's tmp_path is under /tmp
    model.parent.mkdir()
    model.write_bytes(b"not opened by the plan")
    assert str(model).startswith("/tmp/")
    _, replicas = plan.plan(tiny_job(model=str(model)), tmp_path / "run")
    assert [arg(r, "--model") for r in replicas] == [str(model)] * 2
    assert not any(str(model) in why for r in replicas for why in r.rewritten.values())


def test_a_missing_model_is_refused_naming_the_path_looked_up_and_why(tmp_path):
    missing = tmp_path / "me" / "missing.keras"
    with pytest.raises(jobspec.InvalidSpec) as e:
        plan.plan(tiny_job(model=str(missing)), tmp_path / "run")
    assert "spec.trainer.model: no such file" in str(e.value)
    assert f"looked up {missing} on this machine" in str(e.value)
    assert "outside the pod's volumes" in str(e.value)


def test_only_tmp_itself_is_the_pods_scratch_space(tmp_path):
    _, replicas = plan.plan(tiny_job(), tmp_path / "run")
    for r in replicas:
        home = Path(r.env["HOME"])  # HOME=/tmp in the pod: the replica's own scratch dir
        assert home.is_relative_to(tmp_path / "run" / "pods" / r.name) and str(home) in r.dirs
        assert r.rewritten[str(home)] == "/tmp in the pod (volume tmp, mounted at /tmp)"


def test_the_interpreter_of_an_mpi_launcher_under_tmp_is_never_rewritten(tmp_path, monkeypatch):
    """A checkout under /tmp: the launcher's mpirun runs the ranks with this interpreter."""
    python = "/tmp/clone/.venv/bin/python"
    monkeypatch.setattr(sys, "executable", python)
    obj = plan.read_job(str(ROOT / "examples" / "mpi4py-allreduce.yaml"))
    _, replicas = plan.plan(obj, tmp_path / "run")
    launcher = next(r for r in replicas if r.role == "launcher")
    assert launcher.argv[0] == python and python in launcher.argv[1:]
    assert not any("volumes/tmp" in a for r in replicas for a in r.argv)


def user_volume_job(mount: str, *args: str) -> dict:
    obj = command_job("paths", "pass", replicas=1)
    pod = obj["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    pod["containers"][0]["args"] = list(args)
    pod["containers"][0]["volumeMounts"] = [{"name": "models", "mountPath": mount}]
    pod["volumes"] = [{"name": "models", "emptyDir": {}}]
    return obj


def test_a_path_in_a_volume_the_user_declared_is_made_local_and_says_why(tmp_path):
    _, (r,) = plan.plan(user_volume_job("/models", "/models/m.keras"), tmp_path / "run")
    local = str(tmp_path / "run" / "pods" / "paths-worker-0" / "volumes" / "models" / "m.keras")
    assert r.argv[-1] == local
    assert r.rewritten[local] == "/models/m.keras in the pod (volume models, mounted at /models)"


def test_a_users_existing_file_where_their_volume_is_mounted_stays_theirs(tmp_path):
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "m.keras").write_bytes(b"")
    _, (r,) = plan.plan(
        user_volume_job(str(mine), str(mine / "m.keras"), str(mine / "out.keras")),
        tmp_path / "run",
    )
    local = tmp_path / "run" / "pods" / "paths-worker-0" / "volumes" / "models"
    # the existing file is the user's; a path that is not there yet is the pod's volume
    assert r.argv[-2:] == (str(mine / "m.keras"), str(local / "out.keras"))


def test_the_checkout_is_never_rewritten_even_under_a_mounted_volume(tmp_path):
    # mounted on the checkout itself: its parent may be /tmp, where the operator mounts its own
    # volume (two volumes at one mountPath are refused at admission, as the API server would)
    inside = str(ROOT / "no-such-file-yet")
    _, (r,) = plan.plan(user_volume_job(str(ROOT), inside), tmp_path / "run")
    assert r.argv[-1] == inside


def test_a_user_keras_model_under_a_tmp_dir_trains(tmp_path):
    """End to end, the issue's case: a .keras file at /tmp/…/me/my_model.keras (here the
    keras-model example's own export, 2 steps) trains where the user keeps it."""
    example = yaml.safe_load((ROOT / "examples" / "keras-model.yaml").read_text())
    example["spec"]["replicaSpecs"]["Worker"]["replicas"] = 1
    example["spec"]["trainer"]["steps"] = 2
    exported = run([str(write(tmp_path, example)), "--json"], cwd=tmp_path)
    export = json.loads(exported.stdout.strip().splitlines()[-1])["export"]
    assert export and Path(export).is_file(), exported.stderr[-3000:]
    model = tmp_path / "me" / "my_model.keras"
    model.parent.mkdir()
    model.write_bytes(Path(export).read_bytes())
    example["metadata"]["name"] = "usermodel"
    example["spec"]["trainer"]["model"] = str(model)
    proc = run([str(write(tmp_path, example)), "--json"], cwd=tmp_path)
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (proc.returncode, final["phase"], final["steps"]) == (0, "Succeeded", 2), proc.stderr[
        -3000:
    ]


@pytest.fixture
def interpreter_under_tmp(tmp_path: Path) -> Path:
    """This interpreter and its environment as a checkout under /tmp has them: the same
    packages, a ``sys.executable`` of ``/tmp/…/clone/.venv/bin/python``."""
    venv = tmp_path / "clone" / ".venv"
    (venv / "bin").mkdir(parents=True)
    if sys.prefix != sys.base_prefix:  # a virtualenv: its config and packages
        (venv / "pyvenv.cfg").write_bytes((Path(sys.prefix) / "pyvenv.cfg").read_bytes())
        (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    python = venv / "bin" / "python"
    python.symlink_to(Path(sys.executable).resolve())
    assert str(python).startswith("/tmp/")
    return python


@pytest.mark.mpi
@pytest.mark.parametrize("example", ["mpi4py-allreduce", "mpi-horovod-style"])
def test_both_mpi_examples_run_with_an_interpreter_under_tmp(
    example, interpreter_under_tmp, tmp_path
):
    """Issue 34: mpirun's ranks were started as <run dir>/…/volumes/tmp/…/python (exit 132)."""
    manifest = ROOT / "examples" / f"{example}.yaml"
    command = [str(interpreter_under_tmp), "-m", "ringtrain.cli", "run", "--json"]
    out = subprocess.run(
        [*command, "--run-dir", str(tmp_path / "run"), str(manifest)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert (out.returncode, final["phase"]) == (0, "Succeeded"), out.stderr[-3000:]
    assert final["exit_codes"]["launcher-0"] == 0
