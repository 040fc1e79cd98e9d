"""The Python client's pieces without processes: the TrainingJob ``fit`` builds (``spec=``
reaches every field), the metrics folded from a chief's lines, the cluster backend's size
refusal and the fields naming its ConfigMaps."""

from __future__ import annotations

import json

import pytest

from ringtrain_client import build, kube
from ringtrain_client.jobs import fold_metrics
from ringtrain_operator import spec as jobspec


def test_the_job_fit_builds_is_valid_and_spec_overrides_any_field():
    obj = build.job_object(
        "mlp-1a2b",
        workers=4,
        batch_size=128,
        epochs=None,
        steps=10,
        trainer={"model": "/m.keras", "dataDir": "/d.npz"},
        spec={"trainer": {"learningRate": 0.01}, "runPolicy": {"backoffLimit": None}},
    )
    t = obj["spec"]["trainer"]
    assert t["batchSize"] == 32 and t["steps"] == 10 and t["learningRate"] == 0.01
    assert t["export"] == {"path": "model.keras"} and t["model"] == "/m.keras"
    assert obj["spec"]["replicaSpecs"]["Worker"]["replicas"] == 4
    assert "backoffLimit" not in obj["spec"]["runPolicy"]  # None removes
    jobspec.load(obj)  # the operator's own parse accepts it


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="global batch"):
        build.per_worker_batch(10, 4)
    with pytest.raises(ValueError, match="steps or epochs"):
        build.job_object("a", workers=1, batch_size=None, epochs=1, steps=1, trainer={})
    assert build.job_name("My Model_2").startswith("my-model-2-")
    assert build.job_name("123").startswith("job-")


def test_metrics_fold_progress_and_evaluations_and_a_restart():
    lines = [
        "ringtrain worker: a log line",
        json.dumps({"event": "progress", "step": 1, "epoch": 0, "loss": 2.0}),
        json.dumps({"event": "progress", "step": 5, "epoch": 0, "loss": 1.5}),
        json.dumps(
            {"event": "eval", "step": 5, "test_accuracy": 0.5, "test_metrics": {"auc": 0.6}}
        ),
        json.dumps({"event": "progress", "step": 4, "epoch": 0, "loss": 1.6}),  # resumed
        json.dumps({"event": "progress", "step": 8, "epoch": 1, "loss": 1.0}),
        json.dumps({"event": "final", "steps": 8, "loss": 1.0, "export": "/x/model.keras"}),
    ]
    m = fold_metrics(lines)
    h = m.history
    assert h["step"] == [1, 4, 8] and h["loss"] == [2.0, 1.6, 1.0]
    assert h["test_accuracy"] == [0.5] and h["test_auc"] == [0.6] and h["eval_step"] == [5]
    assert m.final is not None and m.final.export == "/x/model.keras"


def test_the_cluster_backend_refuses_a_file_over_a_configmap_and_names_its_configmaps():
    assert kube.too_big(1 << 20, "the model") is None
    why = kube.too_big((1 << 20) + 1, "the data (data.npz)")
    assert why is not None and "1,048,577 bytes" in why and "1,048,576" in why
    t = kube.trainer_fields("mlp-1a2b")
    assert t["modelFrom"] == {"configMap": {"name": "mlp-1a2b-model", "key": "model.keras"}}
    assert t["data"]["volume"] == {"configMap": {"name": "mlp-1a2b-data"}}
    obj = build.job_object("mlp-1a2b", workers=2, batch_size=None, epochs=1, steps=None, trainer=t)
    jobspec.load(obj)
