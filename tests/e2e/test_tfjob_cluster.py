"""Kubeflow's own TFJob example on the local cluster (issue 34): training-operator's
examples/tensorflow/simple.yaml — a `kubeflow.org/v1` TFJob, two Workers under OnFailure, a
container named `tensorflow` — with its image swapped for the project's (no registry here) and
its MNIST script for one that does what a MultiWorkerMirroredStrategy does first: read
TF_CONFIG, listen on its own address and reach every peer at theirs through the cluster's DNS.
`ringtrain submit` converts and creates it; it Succeeds only if every worker reached the other."""

from __future__ import annotations

import json

import pytest
import yaml
from support.procs import ringtrain

pytestmark = pytest.mark.e2e

#: TF_CONFIG's cluster, met as TensorFlow's collective ops meet it: each task listens on its
#: own host:port and connects to every other one (retrying while the peers start)
SCRIPT = """
import json, os, socket, time
tf = json.loads(os.environ["TF_CONFIG"])
me = tf["cluster"][tf["task"]["type"]][tf["task"]["index"]]
peers = [a for addrs in tf["cluster"].values() for a in addrs if a != me]
server = socket.create_server(("", int(me.rsplit(":", 1)[1])))
server.settimeout(0.2)
reached, deadline = set(), time.monotonic() + 120
while len(reached) < len(peers):
    assert time.monotonic() < deadline, f"{me} never reached {set(peers) - reached}"
    for p in set(peers) - reached:
        host, port = p.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            reached.add(p)
        except OSError:
            time.sleep(0.2)
    try:
        server.accept()[0].close()
    except OSError:
        pass
end = time.monotonic() + 5  # stay reachable while the others finish
while time.monotonic() < end:
    try:
        server.accept()[0].close()
    except OSError:
        pass
print(json.dumps({"task": tf["task"], "reached": sorted(reached)}), flush=True)
"""


def kubeflow_simple(image: str) -> dict:
    """training-operator's examples/tensorflow/simple.yaml, the image and command swapped, its
    `namespace: kubeflow` dropped (the test's namespace is given to submit), and its pods kept
    after the job ends (`cleanPodPolicy: None`) so both workers' logs can be read."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "tfjob-simple"},
        "spec": {
            "tfReplicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "tensorflow",
                                    "image": image,
                                    "imagePullPolicy": "Never",
                                    "command": ["python", "-c", SCRIPT],
                                    "resources": {"requests": {"cpu": "10m"}},
                                }
                            ]
                        }
                    },
                }
            },
            # the workers' logs are read once the job has ended: Kubeflow's default,
            # Running, would delete a worker still running then (worker 1 stays reachable 5 s)
            "runPolicy": {"cleanPodPolicy": "None"},
        },
    }


def test_kubeflows_simple_tfjob_runs_on_the_cluster_and_its_workers_reach_each_other(
    kubeconfig, kubectl, namespace, operator, project_image, tmp_path
):
    manifest = tmp_path / "simple.yaml"
    manifest.write_text(yaml.safe_dump(kubeflow_simple(project_image)))
    cluster = ("--backend", "kubernetes", "-n", namespace, "--kubeconfig", kubeconfig)
    out = ringtrain("submit", str(manifest), *cluster)
    assert out.returncode == 0, out.stderr
    assert "kubeflow.org/v1 TFJob -> ringtrain.io/v1alpha1 TrainingJob" in out.stderr
    waited = ringtrain("wait", "tfjob-simple", "--timeout", "240", *cluster, timeout_s=270)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    logs = ringtrain("logs", "tfjob-simple", *cluster).stdout
    results = [json.loads(ln.split("| ", 1)[1]) for ln in logs.splitlines() if '"reached"' in ln]
    tasks = sorted((r["task"]["type"], r["task"]["index"]) for r in results)
    assert tasks == [("worker", 0), ("worker", 1)], logs[-3000:]
    assert all(len(r["reached"]) == 1 for r in results), results
    job = json.loads(kubectl("get", "tj", "tfjob-simple", "-n", namespace, "-o", "json").stdout)
    worker = job["spec"]["replicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure" and worker["replicas"] == 2
