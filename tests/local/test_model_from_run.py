"""`ringtrain run` of spec.trainer.modelFrom (decision 0206): a ConfigMap or Secret written in
the job's own file is mounted as the kubelet would, what cannot be provided here is refused
naming the field, and a real Keras model shipped that way trains from exactly its weights.
examples/keras-model-configmap.yaml is run here too."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import yaml
from support.procs import ringtrain
from support.shipped_model import save_trained
from test_local_run import tiny_job

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras

from ringtrain_localrun import plan, sources
from ringtrain_operator import modelfrom
from ringtrain_operator import spec as jobspec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "keras-model-configmap.yaml"
MOUNTED = "/var/run/ringtrain/model/model.keras"

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)


def _configmap(name: str = "my-model", content: bytes = b"PK\x03\x04 weights", **extra) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, **extra},
        "binaryData": {"model.keras": base64.b64encode(content).decode()},
    }


def _arg(replica: plan.Replica, flag: str) -> str:
    argv = list(replica.argv)
    return argv[argv.index(flag) + 1]


def test_a_configmap_of_the_jobs_file_is_mounted_and_the_worker_reads_it_there(tmp_path):
    obj = tiny_job(modelFrom={"configMap": {"name": "my-model"}})
    job, replicas = plan.plan(obj, tmp_path, sources=[_configmap()])
    for r in replicas:
        local = _arg(r, "--model")
        assert Path(local).is_relative_to(tmp_path / "pods" / r.name)
        assert r.files[local] == b"PK\x03\x04 weights"
        assert r.rewritten[local] == (
            f"{MOUNTED} in the pod (volume ringtrain-model, mounted at /var/run/ringtrain/model)"
        )
    said = sources.model_from(job, [_configmap()])
    assert said == (
        "spec.trainer.modelFrom: ConfigMap 'my-model' key 'model.keras' (12 bytes, from the "
        f"job's file) mounted read-only at {MOUNTED}"
    )


def test_a_secret_of_the_jobs_file_is_mounted_too(tmp_path):
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "weights"},
        "data": {"m.keras": base64.b64encode(b"PK\x03\x04 secret").decode()},
    }
    obj = tiny_job(modelFrom={"secret": {"name": "weights", "key": "m.keras"}})
    _, replicas = plan.plan(obj, tmp_path, sources=[secret])
    assert {r.files[_arg(r, "--model")] for r in replicas} == {b"PK\x03\x04 secret"}


@pytest.mark.parametrize(
    "model_from, beside, words",
    [
        (
            {"persistentVolumeClaim": {"claimName": "models", "path": "mnist/big.keras"}},
            [],
            "spec.trainer.modelFrom.persistentVolumeClaim: ringtrain run has no cluster to bind "
            "claim 'models' from; to run this job here, give the file's path on this machine as "
            "spec.trainer.model instead (e.g. model: /home/me/big.keras)",
        ),
        (
            {"configMap": {"name": "my-model"}},
            [],
            "spec.trainer.modelFrom.configMap.name: ConfigMap 'my-model' is not in the job's "
            "file; ringtrain run mounts a ConfigMap only from the TrainingJob's own "
            "multi-document YAML file (append the output of `ringtrain model-configmap FILE "
            "--name my-model`)",
        ),
        (
            {"configMap": {"name": "my-model", "key": "other.keras"}},
            [_configmap()],
            "spec.trainer.modelFrom.configMap.key: ConfigMap 'my-model' in the job's file has "
            "no key 'other.keras' (its keys: model.keras)",
        ),
        (
            {"configMap": {"name": "my-model"}},
            [_configmap(namespace="elsewhere")],
            "ConfigMap 'my-model' is not in the job's file",
        ),
        (
            {"configMap": {"name": "my-model"}},
            [_configmap(content=b"\0" * modelfrom.MAX_OBJECT_BYTES)],
            "spec.trainer.modelFrom.configMap: ConfigMap 'my-model' is 1,048,587 bytes; a "
            "ConfigMap or Secret holds at most 1,048,576",
        ),
    ],
    ids=["claim", "missing", "no-key", "other-namespace", "over-1-MiB"],
)
def test_what_ringtrain_run_cannot_mount_is_refused_naming_the_field(
    tmp_path, model_from, beside, words
):
    with pytest.raises(jobspec.InvalidSpec) as e:
        plan.plan(tiny_job(modelFrom=model_from), tmp_path / "run", sources=beside)
    assert words in str(e.value)
    assert not (tmp_path / "run").exists()


def test_ringtrain_run_says_what_it_mounted_and_refuses_naming_the_field(tmp_path):
    job = tiny_job(modelFrom={"configMap": {"name": "absent"}})
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump_all([job, _configmap()]))
    out = ringtrain("run", str(manifest), "--run-dir", str(tmp_path / "run"), timeout_s=60)
    assert out.returncode == 2
    assert "spec.trainer.modelFrom.configMap.name: ConfigMap 'absent' is not in" in out.stderr


def test_a_real_keras_model_shipped_in_a_configmap_trains_from_exactly_its_weights(tmp_path):
    """Keras trains a model and saves it; `ringtrain model-configmap` puts it in the job's
    file; one step at the saved learning rate (1e-9) later, ringtrain's test accuracy is Keras'
    own of those weights (a fresh model would score ≈ 0.1)."""
    accuracy = save_trained(tmp_path / "trained.keras")
    assert accuracy > 0.7
    made = ringtrain(
        "model-configmap", str(tmp_path / "trained.keras"), "--name", "trained", timeout_s=60
    )
    assert made.returncode == 0, made.stderr
    job = tiny_job("shipped", modelFrom={"configMap": {"name": "trained"}}, steps=1)
    del job["spec"]["trainer"]["evalEvery"]
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job) + "---\n" + made.stdout)

    out = ringtrain("run", str(manifest), "--json", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"ringtrain run: {manifest}: spec.trainer.modelFrom: ConfigMap 'trained' key "
        f"'model.keras' ({os.path.getsize(tmp_path / 'trained.keras'):,} bytes, from the job's "
        f"file) mounted read-only at {MOUNTED}"
    ) in out.stderr
    assert "optimizer SGD(learning_rate=1e-09" in out.stderr  # the file's compile() runs
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert (final["phase"], final["steps"]) == ("Succeeded", 1)
    assert final["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_the_example_ships_a_real_keras_model_and_trains_from_it(tmp_path):
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    (tmp_path / "pooled.keras").write_bytes(base64.b64decode(cm["binaryData"]["model.keras"]))
    model = keras.saving.load_model(tmp_path / "pooled.keras")
    assert [type(layer).__name__ for layer in model.layers] == [
        "Reshape",
        "AveragePooling2D",
        "Flatten",
        "Dense",
    ]
    out = ringtrain("run", str(EXAMPLE), "--json", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ConfigMap 'pooled-digits' key 'model.keras'" in out.stderr
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["phase"] == "Succeeded" and final["test_accuracy"] >= 0.8  # trained weights
