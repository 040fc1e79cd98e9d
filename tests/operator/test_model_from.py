"""spec.trainer.modelFrom (decision 0206): a model file shipped from a ConfigMap, a Secret or a
PersistentVolumeClaim — the pods' read-only volume and ``--model``, the refusals naming the
field, ``ringtrain model-configmap`` and ``ringtrain render`` of a file that holds the
ConfigMap. Pure functions; the file loading in Keras is tests/local/test_model_from_run.py's,
the cluster's tests/e2e/test_model_from_cluster.py's."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile

import kubernetes_validate
import pytest
import yaml
from operator_jobs import job_obj
from support.procs import CLI

from ringtrain.errors import InvalidSpec
from ringtrain_operator import admission, manifests, modelfrom, mpi, render, spec

MOUNT = "/var/run/ringtrain/model"


def _job(model_from: dict, **trainer) -> spec.Job:
    return admission.load(
        job_obj(trainer={"dataset": "mnist-5k", "steps": 4, "modelFrom": model_from, **trainer})
    )


def _main(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def _model_arg(c: dict) -> str:
    return c["args"][c["args"].index("--model") + 1]


@pytest.mark.parametrize(
    "model_from, volume, path",
    [
        (
            {"configMap": {"name": "my-model"}},  # key defaults to model.keras (the CRD)
            {
                "configMap": {
                    "name": "my-model",
                    "items": [{"key": "model.keras", "path": "model.keras"}],
                    "defaultMode": 0o440,
                }
            },
            f"{MOUNT}/model.keras",
        ),
        (
            {"secret": {"name": "weights", "key": "mnist.keras"}},
            {
                "secret": {
                    "secretName": "weights",
                    "items": [{"key": "mnist.keras", "path": "mnist.keras"}],
                    "defaultMode": 0o440,
                }
            },
            f"{MOUNT}/mnist.keras",
        ),
        (
            {"persistentVolumeClaim": {"claimName": "models", "path": "./mnist/big.keras"}},
            {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            f"{MOUNT}/mnist/big.keras",
        ),
    ],
    ids=["configMap", "secret", "persistentVolumeClaim"],
)
def test_every_trainer_pod_mounts_the_model_read_only_and_the_worker_gets_its_path(
    model_from, volume, path
):
    j = _job(model_from)
    assert j.trainer.model == path  # what the memory plan and ringtrain run see
    for pod in manifests.pods(j):
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols[modelfrom.VOLUME] == {"name": modelfrom.VOLUME, **volume}
        c = _main(pod)
        assert {"name": modelfrom.VOLUME, "mountPath": MOUNT, "readOnly": True} in c["volumeMounts"]
        assert _model_arg(c) == path and c["args"].count("--model") == 1
        kubernetes_validate.validate(pod, "1.25.0", strict=True)


def test_without_model_from_there_is_no_model_volume():
    j = admission.load(job_obj())
    pod = manifests.pod(j, j.replica("worker"), 0)
    assert modelfrom.VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    assert _model_arg(_main(pod)) == "cnn"


@pytest.mark.parametrize(
    "model", ["cnn2", "/models/m.keras", {"class_name": "Sequential", "config": {"layers": []}}]
)
def test_a_model_besides_model_from_is_refused_naming_both_fields(model):
    with pytest.raises(InvalidSpec) as e:
        _job({"configMap": {"name": "m"}}, model=model)
    assert "spec.trainer.model and spec.trainer.modelFrom: both name the model" in str(e.value)


def test_the_default_model_beside_model_from_is_what_the_api_server_filled_in():
    assert _job({"configMap": {"name": "m"}}, model="cnn").trainer.model == f"{MOUNT}/model.keras"


@pytest.mark.parametrize(
    "model_from, field",
    [
        ({}, "spec.trainer.modelFrom"),  # none of the three
        (
            {"configMap": {"name": "a"}, "secret": {"name": "b"}},  # two at once
            "spec.trainer.modelFrom",
        ),
        ({"configMap": {"key": "model.keras"}}, "spec.trainer.modelFrom.configMap"),  # no name
        ({"configMap": {"name": "m", "key": "model.h5"}}, "spec.trainer.modelFrom.configMap.key"),
        ({"secret": {"name": "m", "key": "../m.keras"}}, "spec.trainer.modelFrom.secret.key"),
        (
            {"persistentVolumeClaim": {"claimName": "c", "path": "/abs/m.keras"}},
            "spec.trainer.modelFrom.persistentVolumeClaim.path",
        ),
        (
            {"persistentVolumeClaim": {"claimName": "c", "path": "a/../../etc/m.keras"}},
            "spec.trainer.modelFrom.persistentVolumeClaim.path",
        ),
        (
            {"persistentVolumeClaim": {"claimName": "c"}},
            "spec.trainer.modelFrom.persistentVolumeClaim",
        ),
        ({"configmap": {"name": "m"}}, "spec.trainer.modelFrom"),
    ],
)
def test_a_model_from_that_cannot_run_is_refused_naming_the_field(model_from, field):
    with pytest.raises(InvalidSpec) as e:
        _job(model_from)
    assert str(e.value).startswith(field + ":") or f"; {field}:" in str(e.value), str(e.value)


@pytest.mark.parametrize("model_from", [{}, {"configMap": {"name": "a"}, "secret": {"name": "b"}}])
def test_none_or_two_sources_say_to_set_exactly_one(model_from):
    with pytest.raises(InvalidSpec, match="set exactly one of configMap, secret, persistentVolume"):
        _job(model_from)


def test_a_misspelt_source_says_which_one_was_meant():
    with pytest.raises(InvalidSpec, match="'configmap': did you mean 'configMap'"):
        _job({"configmap": {"name": "m"}})


def test_the_checkpoints_cannot_take_the_models_mount_path():
    with pytest.raises(InvalidSpec) as e:
        _job({"configMap": {"name": "m"}}, checkpoint={"path": MOUNT})
    assert str(e.value).startswith("spec.trainer.checkpoint.path:")
    assert "the model's (spec.trainer.modelFrom) volume" in str(e.value)


def test_an_mpi_launcher_does_not_mount_the_model_its_workers_train():
    obj = job_obj(
        trainer={"dataset": "mnist-5k", "steps": 4, "modelFrom": {"secret": {"name": "m"}}}
    )
    obj["spec"]["mpi"] = {}
    j = spec.load(obj)
    pods = {p["metadata"]["name"]: p for p in mpi.pods(j)}
    launcher = pods["mnist-launcher"]
    assert modelfrom.VOLUME not in {v["name"] for v in launcher["spec"]["volumes"]}
    c = _main(launcher)
    assert f"{MOUNT}/model.keras" in " ".join(c["command"] + c.get("args", []))
    worker = pods["mnist-worker-0"]
    assert modelfrom.VOLUME in {v["name"] for v in worker["spec"]["volumes"]}


# --- ringtrain model-configmap ---------------------------------------------------------------


def _keras_file(path, size: int = 100) -> bytes:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("config.json", "{}")
        z.writestr("model.weights.h5", b"\0" * size)
    return path.read_bytes()


def test_model_configmap_prints_the_file_as_binary_data_with_its_digest(tmp_path):
    content = _keras_file(tmp_path / "my.keras")
    out = subprocess.run(
        [*CLI, "model-configmap", str(tmp_path / "my.keras"), "--name", "my-model", "-n", "ml"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("# my.keras (")
    assert "spec.trainer.modelFrom: {configMap: {name: my-model, key: model.keras}}" in out
    assert "kubectl create -f" in out
    (cm,) = yaml.safe_load_all(out)
    kubernetes_validate.validate(cm, "1.25.0", strict=True)
    assert cm["metadata"]["name"] == "my-model" and cm["metadata"]["namespace"] == "ml"
    assert base64.b64decode(cm["binaryData"]["model.keras"]) == content
    sha = cm["metadata"]["annotations"][modelfrom.SHA256_ANNOTATION]
    assert sha == hashlib.sha256(content).hexdigest()


def test_model_configmap_refuses_a_file_over_1_mib_pointing_at_the_claim(tmp_path):
    _keras_file(tmp_path / "big.keras", size=modelfrom.MAX_OBJECT_BYTES)
    p = subprocess.run(
        [*CLI, "model-configmap", str(tmp_path / "big.keras"), "--name", "big"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert "at most 1,048,576 (1 MiB, Kubernetes' limit)" in p.stderr
    assert "spec.trainer.modelFrom.persistentVolumeClaim {claimName, path}" in p.stderr


@pytest.mark.parametrize(
    "name, content, key, words",
    [
        ("m.h5", b"PK\x03\x04", None, "not a .keras or .json model file"),
        ("m.keras", b"not a zip", None, "not a .keras archive"),
        ("m.keras", b"PK\x03\x04", "model.json", "--key 'model.json': letters"),
        ("m.keras", b"PK\x03\x04", "a/b.keras", "--key 'a/b.keras': letters"),
    ],
)
def test_model_configmap_refuses_what_the_worker_could_not_read(
    tmp_path, name, content, key, words
):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InvalidSpec, match=words):
        modelfrom.configmap_text(str(tmp_path / name), "m", key)


def test_a_json_model_gets_a_json_key(tmp_path):
    (tmp_path / "m.json").write_text('{"class_name": "Sequential"}')
    (cm,) = yaml.safe_load_all(modelfrom.configmap_text(str(tmp_path / "m.json"), "m"))
    assert list(cm["binaryData"]) == ["model.json"]


def test_render_prints_the_jobs_objects_not_the_configmap_beside_it(tmp_path):
    content = _keras_file(tmp_path / "my.keras")
    job = job_obj(trainer={"steps": 4, "modelFrom": {"configMap": {"name": "my-model"}}})
    docs = [job, yaml.safe_load(modelfrom.configmap_text(str(tmp_path / "my.keras"), "my-model"))]
    objects = render.render(docs)
    assert "ConfigMap" not in {o["kind"] for o in objects}
    assert content  # the ConfigMap is the user's to create (kubectl create -f the file)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert pods and all(_model_arg(_main(p)) == f"{MOUNT}/model.keras" for p in pods)
