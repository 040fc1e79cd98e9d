"""docs/tutorial.ipynb run as Jupyter runs it: nbclient drives a real ipykernel kernel of this
virtualenv through the notebook's cells (issue 36). The kernel fits a compiled Keras model on 2
worker processes, waits — its progress line one display output updated in place — loads the
export and evaluates it; the assertions read what the cells printed and displayed. Also: the
committed notebook carries no outputs, and docs/tutorial.md is its current rendering.
Imports TensorFlow in the kernel (~10 s); the whole run takes a few tens of seconds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gen_docs
import nbformat
import notebook_page
from ipykernel.kernelspec import install
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"
#: the kernel the notebook names (ipykernel's own, which pip installs into the virtualenv)
KERNEL = "python3"
#: seconds any one cell may take: the training cell is ~5 s of job and ~10 s of TensorFlow
CELL_TIMEOUT_S = 300


def _cell(nb: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.get("id") == cell_id)


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(
        o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stdout"
    )


def test_the_tutorial_trains_on_two_workers_in_a_real_kernel(tmp_path, monkeypatch):
    # jupyter_client offers ipykernel's own python3 even without a kernel.json; where a
    # configuration hides it, this virtualenv's is installed for the test, first on the path
    if KERNEL not in KernelSpecManager().find_kernel_specs():
        install(kernel_name=KERNEL, prefix=str(tmp_path / "jupyter"))
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata.kernelspec.name == KERNEL
    probe = nbformat.v4.new_code_cell("import sys; print(sys.prefix)", id="probe")
    nb.cells.append(probe)  # which Python the kernel is

    runs = tmp_path / "work"
    runs.mkdir()
    NotebookClient(
        nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(runs)}}
    ).execute()

    assert _stdout(nb.cells[-1]).strip() == sys.prefix  # this virtualenv's kernel
    train = _cell(nb, "train")
    printed = dict(
        re.findall(r"^(the job's test accuracy|Keras' evaluate) +([0-9.]+)$", _stdout(train), re.M)
    )
    job_acc, keras_acc = (
        float(printed["the job's test accuracy"]),
        float(printed["Keras' evaluate"]),
    )
    assert job_acc > 0.8  # chance is 0.5
    assert abs(keras_acc - job_acc) <= 1 / 256 + 1e-6  # the same 256 rows, the job's 6 digits
    assert _stdout(_cell(nb, "check")).strip() == "agree within one row of 256"

    # wait()'s progress: one display output, updated in place to the job's last line
    shown = [o for o in train.outputs if o["output_type"] == "display_data"]
    assert len(shown) == 1, train.outputs
    line = shown[0]["data"]["text/plain"]
    assert line.startswith("step 30/30 (100%)  ") and f"acc {100 * job_acc:.2f}%" in line, line
    assert "[worker-0 done worker-1 done]" in line, line
    assert len(list((runs / ".ringtrain" / "runs").iterdir())) == 1  # the run it made


def test_the_committed_notebook_has_no_outputs_and_its_page_is_current():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    train = _cell(nb, "train").source.splitlines()
    assert len(train) <= 10, train  # the tutorial's promise: a cell of at most ten lines
    page = gen_docs.ROOT / "docs" / "tutorial.md"
    assert page.read_text() == notebook_page.render(NOTEBOOK), (
        "docs/tutorial.md is stale: run .venv/bin/python hack/gen-docs"
    )
