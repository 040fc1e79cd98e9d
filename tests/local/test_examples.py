"""Every example in examples/ reaches Succeeded under `ringtrain run`, from the environment the
README's setup makes (the test suite's .venv is that environment: `hack/setup` installs the same
lock for `make demo` and `make test`).

keras-model.yaml and evaluator.yaml are run, with more assertions, by test_keras_model_job.py and
test_local_run.py; this module runs the rest and checks that no example is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.procs import ringtrain

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: examples run to Succeeded by other modules (and where)
RUN_ELSEWHERE = {
    "keras-model.yaml": "tests/local/test_keras_model_job.py",
    "keras-model-configmap.yaml": "tests/local/test_model_from_run.py",
    "elastic-mnist.yaml": "tests/local/test_elastic_resize.py",
    "evaluator.yaml": "tests/local/test_local_run.py",
    "mpi-horovod-style.yaml": "tests/local/test_mpi_run.py",
    "mpi4py-allreduce.yaml": "tests/local/test_mpi_run.py",
    "pipelined-model.yaml": "tests/local/test_pipelined_model_job.py",
    "tensorflow-keras-fit.yaml": "tests/local/test_tensorflow_keras_fit.py",
}
RUN_HERE = [
    pytest.param("fashion-mnist-2workers.yaml", id="fashion-mnist-2workers"),
    pytest.param("tensorflow-stock.yaml", id="tensorflow-stock"),
    pytest.param("fashion-mnist-4workers-2ipus.yaml", id="4workers-2ipus"),
]
#: what a test changes in an example, and why: ten epochs on four workers took 411 s on two busy
#: cores; one epoch runs every path of the example (two IPUs per worker, momentum, the decay
#: schedule's first step, the checkpoint volume) in a tenth of that.
SHORTER = {"fashion-mnist-4workers-2ipus.yaml": {"epochs": 1}}


def test_every_example_is_run_by_a_test():
    here = {p.values[0] for p in RUN_HERE}
    assert sorted(here | set(RUN_ELSEWHERE)) == sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    for name, module in RUN_ELSEWHERE.items():
        assert f'"{name}"' in (ROOT / module).read_text() or name in (ROOT / module).read_text()


@pytest.mark.parametrize("name", RUN_HERE)
def test_example_reaches_succeeded(name, tmp_path):
    manifest = EXAMPLES / name
    if name in SHORTER:
        doc = yaml.safe_load(manifest.read_text())
        doc["spec"]["trainer"].update(SHORTER[name])
        manifest = tmp_path / name
        manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    out = ringtrain("run", "--json", "--run-dir", str(run_dir), str(manifest), timeout_s=840)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    final = [doc for doc in lines if doc.get("event") == "final"]
    assert final, f"no final result; stderr tail:\n{out.stderr[-3000:]}"
    assert (final[-1]["phase"], out.returncode) == ("Succeeded", 0), (
        f"{final[-1]}\nstderr tail:\n{out.stderr[-3000:]}"
    )
