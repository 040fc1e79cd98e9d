"""`ringtrain render` and the shipped examples: what users see is what the operator creates."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.procs import CLI

from ringtrain_operator import manifests, networkpolicy, render, spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_three_examples_exist():
    assert {p.name for p in EXAMPLES} >= {
        "fashion-mnist-2workers.yaml",
        "fashion-mnist-4workers-2ipus.yaml",
        "tensorflow-stock.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_render_to_valid_objects(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    objects = render.render(docs)
    assert [o["kind"] for o in objects[:2]] == ["Service", "Secret"]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.25.0", strict=True)


def test_main_example_is_the_seeds_two_worker_job():
    j = spec.load(yaml.safe_load((REPO / "examples/fashion-mnist-2workers.yaml").read_text()))
    assert [(r.role, r.replicas) for r in j.replicas] == [("worker", 2)]
    t = j.trainer
    assert (t.dataset, t.model, t.batch_size) == ("fashion-mnist", "cnn", 64)


def test_render_cli_prints_every_object_with_the_secret_redacted(tmp_path):
    path = REPO / "examples/fashion-mnist-2workers.yaml"
    out = subprocess.run(
        [*CLI, "render", str(path), "-n", "ml"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objects = list(yaml.safe_load_all(out))
    job = spec.load(
        {
            **yaml.safe_load(path.read_text()),
            "metadata": {"name": "fashion-mnist", "namespace": "ml"},
        }
    )
    expected = manifests.desired_objects(job, token="x")
    expected.append(networkpolicy.network_policy(job, networkpolicy.Settings()))
    assert [o["metadata"]["name"] for o in objects] == [o["metadata"]["name"] for o in expected]
    assert objects[-1] == expected[-1]  # the NetworkPolicy the chart's default has created
    assert objects[1]["data"] == dict.fromkeys(
        ("token", "ca.crt", "tls.crt", "tls.key"), render.REDACTED
    )
    assert objects[2] == expected[2]  # pods: byte for byte what the operator creates


def test_render_cli_reports_an_invalid_spec_with_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((REPO / "examples/fashion-mnist-2workers.yaml").read_text())
    doc["spec"]["trainer"]["ipusPerWorker"] = 3
    bad.write_text(yaml.safe_dump(doc))
    r = subprocess.run([*CLI, "render", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "spec.trainer.batchSize: 64 is not divisible by spec.trainer.ipusPerWorker=3" in r.stderr


def test_render_refuses_an_unsupported_inline_keras_model_naming_layer_and_argument(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((REPO / "examples/keras-model.yaml").read_text())
    doc["spec"]["trainer"]["model"]["config"]["layers"][2]["config"]["padding"] = "causal"
    bad.write_text(yaml.safe_dump(doc))
    r = subprocess.run([*CLI, "render", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert "spec.trainer.model: layer 'conv2d' (Conv2D): padding='causal'" in r.stderr
    assert "valid" in r.stderr and "same" in r.stderr


def test_render_crd_prints_the_packaged_crd():
    out = subprocess.run(
        [*CLI, "render", "--crd"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert yaml.safe_load(out) == spec.crd()


def test_render_without_network_policy_leaves_it_out():
    path = REPO / "examples/fashion-mnist-2workers.yaml"
    kinds = [
        [o["kind"] for o in yaml.safe_load_all(out.stdout)]
        for args in ([], ["--no-network-policy"])
        if (
            out := subprocess.run(
                [*CLI, "render", str(path), *args], capture_output=True, text=True, check=True
            )
        )
    ]
    assert kinds == [
        ["Service", "Secret", "Pod", "Pod", "NetworkPolicy"],
        ["Service", "Secret", "Pod", "Pod"],
    ]
