"""``ringtrain submit FILE``: a job's YAML started in the background and followed by name with
the other verbs (locally here; on the cluster: tests/e2e/test_client_cluster.py). A Kubeflow
TFJob file is converted, saying so; a file holding an object submit does not create is refused
whole, naming the document, before anything starts."""

from __future__ import annotations

import json

import yaml
from support.procs import ringtrain


def _job(name: str) -> dict:
    return {
        "apiVersion": "ringtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"Worker": {"replicas": 2}},
            "trainer": {"dataset": "mnist-5k", "steps": 6, "batchSize": 16},
        },
    }


def test_submit_starts_a_job_the_other_verbs_follow_by_name(tmp_path):
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job("sub")))
    root = str(tmp_path / "runs")
    out = ringtrain("submit", str(manifest), "--root", root, "--json", timeout_s=60)
    assert out.returncode == 0, out.stderr
    name = json.loads(out.stdout)["submitted"]
    assert name.startswith("sub-")
    waited = ringtrain("wait", name, "--root", root, "--json", "--timeout", "300")
    assert waited.returncode == 0, waited.stdout + waited.stderr
    st = json.loads(waited.stdout)
    assert (st["phase"], st["step"]) == ("Succeeded", 6)
    logs = ringtrain("logs", name, "--root", root, "--replica", "worker-0")
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr


def test_a_tfjob_file_is_converted_and_a_foreign_object_refuses_the_whole_file(tmp_path):
    script = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['task'])"
    container = {"name": "tensorflow", "image": "tf", "command": ["python", "-c", script]}
    tf = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "tfsub"},
        "spec": {
            "tfReplicaSpecs": {
                "Worker": {"replicas": 2, "template": {"spec": {"containers": [container]}}}
            }
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([tf, service]))
    root = tmp_path / "runs"
    refused = ringtrain("submit", str(bad), "--root", str(root))
    assert refused.returncode == 2
    assert "document 2 is ('v1', 'Service')" in refused.stderr, refused.stderr
    assert not root.exists()  # nothing started

    good = tmp_path / "tf.yaml"
    good.write_text(yaml.safe_dump(tf))
    out = ringtrain("submit", str(good), "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert "kubeflow.org/v1 TFJob -> ringtrain.io/v1alpha1 TrainingJob" in out.stderr
    name = out.stdout.strip()
    waited = ringtrain("wait", name, "--root", str(root), "--timeout", "120")
    assert waited.returncode == 0 and "Succeeded" in waited.stdout, waited.stdout
    logs = ringtrain("logs", name, "--root", str(root)).stdout
    assert "{'type': 'worker', 'index': 1}" in logs, logs  # TF_CONFIG, as Kubeflow writes it
