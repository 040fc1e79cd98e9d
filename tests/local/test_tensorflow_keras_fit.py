"""A TFJob user's typical file and script — Keras' ``model.fit`` under TensorFlow's
MultiWorkerMirroredStrategy, reading the TF_CONFIG the operator writes — trains under
``ringtrain run``, as examples/tensorflow-keras-fit.yaml and as a ``kubeflow.org/v1`` TFJob
file (Keras 2 as tf_keras, TF_USE_LEGACY_KERAS=1: decision 0214), and two workers train as one
does: the strategy splits the same global batch of the same samples, so the loss per epoch and
the test accuracy of a 2-worker run equal a 1-worker run's (measured: equal to 1e-6). Workers
that trained apart (no TF_CONFIG, each alone on half the batches) or on other data would
differ."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.procs import ringtrain

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensorflow-keras-fit.yaml"


def _as_tfjob(doc: dict) -> dict:
    """The job as Kubeflow's keras-API example writes it (training-operator
    examples/tensorflow/distribution_strategy/keras-API/multi_worker_tfjob.yaml: a
    ``kubeflow.org/v1`` TFJob, Worker replicas without a restartPolicy, a container named
    ``tensorflow``, ``cleanPodPolicy: None``), with this example's image and script."""
    worker = doc["spec"]["replicaSpecs"]["Worker"]
    del worker["restartPolicy"]
    worker["template"]["spec"]["containers"][0]["name"] = "tensorflow"
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": doc["metadata"],
        "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "tfReplicaSpecs": {"Worker": worker}},
    }


def _run(tmp_path: Path, workers: int, tfjob: bool = False) -> list[dict]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["replicaSpecs"]["Worker"]["replicas"] = workers
    if tfjob:
        doc = _as_tfjob(doc)
    manifest = tmp_path / f"fit-{workers}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / f"run-{workers}"
    out = ringtrain("run", "--run-dir", str(run_dir), str(manifest), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:]
    if tfjob:  # converted, and said so
        assert "kubeflow.org/v1 TFJob -> ringtrain.io/v1alpha1 TrainingJob" in out.stderr, (
            out.stderr
        )
    results = []
    for i in range(workers):
        log = (run_dir / "pods" / f"tf-keras-fit-worker-{i}" / "log").read_text()
        results.append(json.loads(next(x for x in log.splitlines() if x.startswith('{"keras"'))))
    return results


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_model_fit_under_multiworkermirroredstrategy_on_two_workers_trains_as_one(tmp_path):
    (one,) = _run(tmp_path, 1)
    two = _run(tmp_path, 2, tfjob=True)  # Kubeflow's TFJob file, run as it is
    assert [r["workers"] for r in two] == [2, 2] and one["workers"] == 1
    for r in (one, *two):
        assert r["keras"].startswith("tf_keras"), r  # Keras 2, as TF_USE_LEGACY_KERAS asks
        assert len(r["loss"]) == 2 and r["loss"][1] < r["loss"][0], r
    assert two[0] == two[1]  # the workers hold one model
    np.testing.assert_allclose(two[0]["loss"], one["loss"], rtol=1e-4)
    assert two[0]["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=2e-3)
    assert one["test_accuracy"] > 0.78, one
    print(json.dumps({"one_worker": one, "two_workers": two[0]}))
