"""spec.load: the CRD's defaults and schema applied locally, and the semantic checks."""

from __future__ import annotations

import re

import pytest
from operator_jobs import job, job_obj

from ringtrain.errors import InvalidSpec
from ringtrain_operator import spec
from ringtrain_operator.job import RunPolicy


def test_defaults_come_from_the_crd():
    obj = job_obj(trainer={})
    del obj["spec"]["replicaSpecs"]["Worker"]["restartPolicy"]
    j = spec.load(obj)
    (worker,) = j.replicas
    assert (worker.role, worker.replicas, worker.restart_policy) == ("worker", 2, "ExitCode")
    assert worker.template == {}
    t = j.trainer
    assert (t.image, t.model, t.dataset, t.batch_size, t.optimizer, t.lr) == (
        "ringtrain:0.1.0",
        "cnn",
        "fashion-mnist",
        64,
        None,  # the model's compile settings (the presets': adam at 0.001)
        None,
    )
    assert (t.steps, t.epochs, t.ipus_per_worker, t.ipu_memory_mb, t.variables_on_host) == (
        None,
        None,
        1,
        900,
        True,
    )
    assert (t.bucket_mb, t.checkpoint_dir, t.checkpoint_every) == (25.0, "/checkpoints", 0)
    assert t.checkpoint_volume is None
    assert (t.ring_transport, t.ring_step_timeout_s, t.ring_connect_timeout_s) == (
        "grpc+tcp",
        30.0,
        120.0,
    )
    assert all(isinstance(x, float) for x in (t.bucket_mb, t.ring_step_timeout_s))
    assert j.run_policy == RunPolicy(
        backoff_limit=6,
        active_deadline_s=None,
        ttl_after_finished_s=None,
        clean_pod_policy="Running",
        suspend=False,
        success_policy="ChiefOrWorker0",
    )


def test_load_does_not_modify_its_input():
    obj = job_obj()
    before = repr(obj)
    spec.load(obj)
    assert repr(obj) == before


def test_roles_in_tf_config_order_and_zero_replicas_dropped():
    j = job(workers=2, chief=1, ps=0, evaluator=1)
    assert [(r.role, r.replicas) for r in j.replicas] == [
        ("chief", 1),
        ("worker", 2),
        ("evaluator", 1),
    ]
    assert j.chief == ("chief", 0)
    assert job(workers=1).chief == ("worker", 0)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (
            lambda o: o["spec"]["trainer"].update(batchSize=63, ipusPerWorker=2),
            "spec.trainer.batchSize: 63 is not divisible by spec.trainer.ipusPerWorker=2",
        ),
        (
            lambda o: o["spec"]["trainer"].update(epochs=2),
            "spec.trainer: set steps or epochs, not both",
        ),
        (
            lambda o: o["spec"]["replicaSpecs"].update(Chief={"replicas": 2}),
            "spec.replicaSpecs.Chief.replicas: 2 is greater than the maximum of 1",
        ),
        (
            lambda o: o["spec"]["replicaSpecs"].pop("Worker"),
            "spec.replicaSpecs: 'Worker' is a required property",
        ),
        (
            lambda o: o["spec"]["replicaSpecs"]["Worker"].update(replicas=0),
            "spec.replicaSpecs.Worker.replicas: 0 is less than the minimum of 1",
        ),
        (
            lambda o: o["spec"]["replicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
            "spec.replicaSpecs.Worker.restartPolicy: 'Sometimes' is not one of",
        ),
        (
            lambda o: o["spec"]["trainer"].update(batchsize=32),
            "spec.trainer: Additional properties are not allowed ('batchsize' was unexpected)",
        ),
        (
            lambda o: o["spec"].update(runPolicy={"cleanPodPolicy": "Some"}),
            "spec.runPolicy.cleanPodPolicy: 'Some' is not one of",
        ),
        (
            lambda o: o["spec"]["trainer"].update(learningRate="fast"),
            "spec.trainer.learningRate: 'fast' is not of type 'number'",
        ),
        (
            lambda o: o["metadata"].update(name="MNIST_job"),
            "metadata.name: 'MNIST_job' must be a DNS-1035 label",
        ),
        (lambda o: o["metadata"].update(name="a" * 50), "metadata.name: 'aaaa"),
        (lambda o: o.update(kind="TFJob"), "apiVersion/kind: expected ringtrain.io/v1alpha1/"),
        (
            lambda o: o["spec"].pop("trainer"),
            "spec.replicaSpecs.Worker.template.spec.containers: "
            "required when spec.trainer is not set",
        ),
        (
            lambda o: (
                o["spec"].pop("trainer"),
                o["spec"]["replicaSpecs"]["Worker"].update(
                    template={"spec": {"containers": [{"name": "tf"}]}}
                ),
            ),
            "spec.replicaSpecs.Worker.template.spec.containers[].image: required",
        ),
    ],
)
def test_invalid_specs_name_the_field(mutate, field):
    obj = job_obj()
    mutate(obj)
    with pytest.raises(InvalidSpec) as e:
        spec.load(obj)
    assert field in str(e.value)


def test_every_schema_error_is_reported_at_once():
    obj = job_obj()
    obj["spec"]["trainer"].update(model="resnet", optimizer="lamb")
    with pytest.raises(InvalidSpec) as e:
        spec.load(obj)
    assert "spec.trainer.model" in str(e.value) and "spec.trainer.optimizer" in str(e.value)


def test_crd_is_structural_with_the_advertised_api():
    crd = spec.crd()
    assert crd["metadata"]["name"] == "trainingjobs.ringtrain.io"
    assert crd["spec"]["names"]["shortNames"] == ["tj"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "State",
        "Workers",
        "Step",
        "Accuracy",
        "Loss",
        "Restarts",
        "Age",
    ]
    text = str(crd)
    assert "x-kubernetes-validations" not in text  # no CEL: Kubernetes 1.20 must accept it

    def walk(schema, path):  # structural: every node has a type (or preserves unknown fields)
        assert "type" in schema or schema.get("x-kubernetes-preserve-unknown-fields"), path
        for k, sub in schema.get("properties", {}).items():
            walk(sub, f"{path}.{k}")
        if "items" in schema:
            walk(schema["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


def test_schema_defaults_are_valid_against_the_schema():
    """The API server rejects a CRD whose defaults fail its own validation."""
    schema = spec.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    import jsonschema

    def walk(node, path):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])
        for k, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{k}")

    walk(schema, "")


@pytest.mark.parametrize(
    "ring, field",
    [
        ({"transport": "udp"}, "spec.trainer.ring.transport"),
        ({"stepTimeoutSeconds": 0}, "spec.trainer.ring.stepTimeoutSeconds"),
        ({"connectTimeoutSeconds": -1}, "spec.trainer.ring.connectTimeoutSeconds"),
        ({"stepTimeout": 5}, "spec.trainer.ring"),
    ],
)
def test_invalid_ring_settings_name_the_field(ring, field):
    """Refused here as the trainer would refuse the flag, so a bad value never reaches a pod."""
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        spec.load(job_obj(trainer={"ring": ring}))


# ---- roles the built-in trainer knows -----------------------------------------------------------


def test_ps_with_the_built_in_trainer_is_refused_saying_what_to_do_instead():
    with pytest.raises(
        InvalidSpec,
        match=r"spec\.replicaSpecs\.PS: the built-in trainer .* "
        r"ring allreduce\. Remove the PS replicas .* stock "
        r"TensorFlow job .* may still use PS",
    ):
        job(workers=2, ps=1, trainer={"dataset": "mnist-5k"})


def test_ps_in_a_stock_tensorflow_job_is_still_accepted():
    j = job(workers=2, ps=1)  # no spec.trainer: the templates' own image and command
    assert j.trainer is None and j.replica("ps").replicas == 1


@pytest.mark.parametrize("checkpoint", [{}, {"volume": {"emptyDir": {}}}])
def test_an_evaluator_with_a_per_pod_checkpoint_volume_is_refused(checkpoint):
    with pytest.raises(
        InvalidSpec,
        match=r"Evaluator: .* emptyDir, which each pod has for "
        r"itself; set spec\.trainer\.checkpoint\.volume",
    ):
        job(workers=1, chief=1, evaluator=1, trainer={"checkpoint": checkpoint})


def test_an_evaluator_with_a_shared_checkpoint_volume_is_accepted_but_only_one():
    shared = {"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}}
    j = job(workers=1, chief=1, evaluator=1, trainer=shared)
    assert j.replica("evaluator").replicas == 1
    with pytest.raises(InvalidSpec, match=r"Evaluator\.replicas: 2 is greater than the maximum"):
        job(workers=1, evaluator=2, trainer=shared)


def test_data_and_export_are_read_and_the_built_in_data_set_cannot_take_a_volume():
    j = job(
        trainer={
            "data": {"volume": {"hostPath": {"path": "/srv/data"}}, "file": "d.npz"},
            "export": {"path": "model.onnx", "format": "onnx"},
        }
    )
    t = j.trainer
    assert (t.data_volume, t.data_mount_path, t.data_file) == (
        {"hostPath": {"path": "/srv/data"}},
        "/data",
        "d.npz",
    )
    assert (t.export, t.export_format) == ("model.onnx", "onnx")
    assert job(trainer={}).trainer.export is None
    with pytest.raises(InvalidSpec, match="dataset mnist-5k is built in"):
        job(trainer={"dataset": "mnist-5k", "data": {"volume": {"emptyDir": {}}}})
    with pytest.raises(InvalidSpec, match="volume"):
        job(trainer={"data": {"file": "d.npz"}})


def _inline_models():
    """Keras 3's to_json (the cnn2 preset, written by Keras 3) and tf.keras 2's (the example)."""
    from pathlib import Path

    import yaml

    from ringtrain_trainer.keras.load import preset_config

    example = Path(__file__).resolve().parents[2] / "examples" / "keras-model.yaml"
    return {
        "keras3": preset_config("cnn2"),
        "tf.keras2": yaml.safe_load(example.read_text())["spec"]["trainer"]["model"],
    }


@pytest.mark.parametrize("fmt", ["keras3", "tf.keras2"])
def test_an_inline_keras_config_is_accepted_and_reaches_the_worker_as_compact_json(fmt):
    import json

    from ringtrain_operator import manifests

    model = _inline_models()[fmt]
    j = spec.load(job_obj(trainer={"dataset": "mnist-5k", "steps": 5, "model": model}))
    assert json.loads(j.trainer.model) == model and " " not in j.trainer.model
    (container,) = manifests.pods(j)[0]["spec"]["containers"]
    args = container["args"]
    assert json.loads(args[args.index("--model") + 1]) == model


def test_an_unsupported_inline_config_names_layer_argument_and_what_is_supported_with_the_rest():
    model = _inline_models()["keras3"]
    conv = next(x for x in model["config"]["layers"] if x["class_name"] == "Conv2D")
    conv["config"]["padding"] = "full"
    obj = job_obj(trainer={"model": model, "optimizer": "lamb"})
    with pytest.raises(InvalidSpec) as e:
        spec.load(obj)
    assert (
        "spec.trainer.model: layer 'conv2d' (Conv2D): padding='full' is not supported "
        "(supported: 'valid' or 'same')"
    ) in str(e.value)
    assert "spec.trainer.optimizer" in str(e.value)


@pytest.mark.parametrize(
    "model, words",
    [
        ({"class_name": "Functional", "config": {}}, "the Functional config has no layers"),
        (
            {"class_name": "MyModel", "config": {}},
            "a Keras Sequential or Functional config is needed, got 'MyModel'",
        ),
        (
            {
                "class_name": "Sequential",
                "config": {
                    "layers": [
                        {
                            "class_name": "ConvLSTM2D",
                            "config": {
                                "name": "rnn",
                                "units": 3,
                                "batch_input_shape": [None, 4, 3],
                            },
                        }
                    ]
                },
            },
            "layer 'rnn' (ConvLSTM2D) is not supported (supported layers: InputLayer, Conv2D",
        ),
        (
            ["cnn"],
            "must be a preset name, a path, or an inline Keras model config (an object), got list",
        ),
        ("/models/net.h5", "'/models/net.h5' is not a preset (cnn, cnn2), the absolute path"),
    ],
)
def test_what_the_model_field_refuses(model, words):
    with pytest.raises(InvalidSpec) as e:
        spec.load(job_obj(trainer={"model": model}))
    assert f"spec.trainer.model: {words}" in str(e.value)


def test_an_inline_config_too_large_for_one_argument_is_refused_saying_what_to_do():
    model = _inline_models()["keras3"]
    model["config"]["layers"][1]["config"]["padding_note"] = "x" * spec.MAX_INLINE_MODEL_BYTES
    with pytest.raises(InvalidSpec) as e:
        spec.load(job_obj(trainer={"model": model}))
    assert "put it in a .json file on a volume" in str(e.value)


def test_the_model_field_is_a_string_or_an_object_in_the_crd():
    node = spec._schema()["properties"]["spec"]["properties"]["trainer"]["properties"]["model"]
    assert "type" not in node and node["x-kubernetes-preserve-unknown-fields"] is True
    assert node["default"] == "cnn" and "pattern" not in node  # spec.py checks strings


@pytest.mark.parametrize(
    ("pod_spec", "field"),
    [
        ({"containers": True}, "template.spec.containers"),
        ({"containers": [1]}, "template.spec.containers"),
        ({"containers": [{"name": "trainer", "volumeMounts": 3}]}, "template.spec.containers[]"),
        ([], "template.spec"),
    ],
)
def test_a_malformed_pod_template_is_refused_naming_the_field(pod_spec, field):
    """Found by the spec fuzzer: a template whose containers were not a list crashed the load
    with a TypeError (the operator's reconcile, render and run alike)."""
    obj = job_obj(trainer={"dataset": "mnist-5k"})
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {"spec": pod_spec}
    with pytest.raises(InvalidSpec, match=re.escape(f"spec.replicaSpecs.Worker.{field}")):
        spec.load(obj)


@pytest.mark.parametrize(
    ("field", "hint"), [("batchsize", "'batchSize'"), ("stpes", "'steps'"), ("epoch", "'epochs'")]
)
def test_a_misspelt_field_is_refused_with_the_field_it_probably_meant(field, hint):
    with pytest.raises(InvalidSpec) as e:
        spec.load(job_obj(trainer={field: 3}))
    assert f"'{field}' was unexpected" in str(e.value)
    assert f"{field!r}: did you mean {hint}?" in str(e.value)


def test_an_unknown_layer_names_the_nearest_supported_ones():
    layers = [
        {"class_name": "InputLayer", "config": {"batch_shape": [None, 4]}},
        {"class_name": "Dence", "config": {"units": 3}},
    ]
    model = {"class_name": "Sequential", "config": {"layers": layers}}
    with pytest.raises(InvalidSpec, match=r"\(Dence\) is not supported .*; did you mean Dense\?"):
        spec.load(job_obj(trainer={"model": model}))
