"""The Python client's local backend end to end (issue 36): a compiled Keras model fitted on 2
real worker processes (``ringtrain run`` underneath), waited for, its metrics read, the export
loaded back by real Keras and evaluated; a failing job's ``wait()`` raising with the worker's
message; a running job deleted; ``ringtrain status|list|wait|delete`` on the same run dirs.
Imports TensorFlow (~10 s)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from support.procs import ringtrain

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)

import keras  # noqa: E402

from ringtrain_client import JobFailed, JobNotFound, TrainerClient  # noqa: E402


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian features decide the class; six are noise."""
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def _model(name: str = "mlp") -> keras.Model:
    m = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ],
        name=name,
    )
    m.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def test_fit_on_two_workers_then_keras_evaluates_the_trained_model(tmp_path, capsys):
    client = TrainerClient(root=tmp_path)
    x, y = _data(512, 0)
    x_test, y_test = _data(256, 1)
    job = client.fit(
        _model(), x, y, validation_data=(x_test, y_test), steps=30, batch_size=64, workers=2
    )
    st = job.wait(timeout=180, progress=True)  # not a terminal: plain progress lines
    assert st.phase == "Succeeded" and st.step == 30, st
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("progress  | ") and "[worker-0 " in shown[-1], shown
    assert shown[-1].startswith("progress  | step 30/30 (100%)"), shown  # the last one
    assert st.test_accuracy is not None and st.test_accuracy > 0.8  # chance is 0.5

    spec = (tmp_path / job.name / "job.yaml").read_text()
    assert "batchSize: 32" in spec and "replicas: 2" in spec  # the global 64 over 2 workers

    m = job.metrics()
    assert m.history["step"][-1] == 30 and all(v is not None for v in m.history["loss"])
    assert m.history["test_accuracy"][-1] == pytest.approx(st.test_accuracy)
    assert m.final is not None and m.final.export == st.export

    trained = job.model()
    assert isinstance(trained, keras.Model) and trained.name == "mlp"
    got = trained.evaluate(x_test, y_test, verbose=0, return_dict=True)
    assert got["accuracy"] == pytest.approx(st.test_accuracy, abs=1 / 256 + 1e-6)

    assert '"event":"final"' in job.logs(replica="worker-0")
    assert [j.name for j in client.list_jobs()] == [job.name]
    assert client.get_job(job.name.rsplit("-", 2)[0]).name == job.name  # the job name: newest

    # the same run dir on the command line
    root = ["--root", str(tmp_path)]
    listed = ringtrain("list", "--json", *root)
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["phase"] == "Succeeded"
    waited = ringtrain("wait", job.name, "--json", *root)
    assert waited.returncode == 0 and json.loads(waited.stdout)["step"] == 30
    shown = ringtrain("status", job.name, *root)
    assert shown.returncode == 0 and "Succeeded" in shown.stdout
    deleted = ringtrain("delete", job.name, *root)
    assert deleted.returncode == 0 and not (tmp_path / job.name).exists()
    gone = ringtrain("status", job.name, *root)
    assert gone.returncode == 2 and "no local run" in gone.stderr


def test_a_failing_job_raises_with_the_workers_message(tmp_path):
    client = TrainerClient(root=tmp_path)
    x, _ = _data(128, 0)
    bad = np.full(len(x), 7, np.int64)  # class 7 of a 2-class softmax
    job = client.fit(_model(), x, bad, validation_data=(x, bad), steps=5, batch_size=32)
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=180)
    assert failed.value.reason == "TrainingJobFailed"
    assert "y_train" in (failed.value.message or ""), failed.value.message
    waited = ringtrain("wait", job.name, "--root", str(tmp_path))
    assert waited.returncode == 1 and "y_train" in waited.stdout


def test_delete_stops_a_running_job(tmp_path):
    client = TrainerClient(root=tmp_path)
    x, y = _data(256, 0)
    job = client.fit(_model(), x, y, validation_data=(x, y), steps=100_000, batch_size=32)
    deadline = time.monotonic() + 120
    while (job.status().step or 0) < 1:
        assert time.monotonic() < deadline, job.status()
        time.sleep(0.3)
    assert job.status().phase == "Running"
    run_dir = tmp_path / job.name
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    pids = [json.loads((run_dir / "run.json").read_text())["pid"]]
    pids += [e["pid"] for e in events if e.get("event") == "started"]
    assert len(pids) == 3  # ringtrain run and its 2 workers
    job.delete()
    assert not (tmp_path / job.name).exists()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(JobNotFound):
        job.status()


def test_refusals_before_anything_runs(tmp_path):
    client = TrainerClient(root=tmp_path)
    x, y = _data(64, 0)
    with pytest.raises(ValueError, match="validation_data"):
        client.fit(_model(), x, y, steps=1)
    with pytest.raises(ValueError, match="multiple of workers=2"):
        client.fit(_model(), x, y, validation_data=(x, y), batch_size=33)
    uncompiled = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not compiled"):
        client.fit(uncompiled, x, y, validation_data=(x, y))
    assert client.list_jobs() == []
