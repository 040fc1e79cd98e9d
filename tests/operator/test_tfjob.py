"""A Kubeflow TFJob becomes a TrainingJob by renames, Kubeflow's defaults kept, and every field
that cannot come along named — and `ringtrain render` / `run` / `convert` take the file as is."""

from __future__ import annotations

import yaml
from support.procs import ringtrain

from ringtrain_operator import spec, tfjob

#: Kubeflow's own example shape: a chief (as Master), workers, a success policy, gang scheduling
TFJOB = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "TFJob",
    "metadata": {"name": "mnist", "namespace": "team-a", "uid": "u-1", "labels": {"a": "b"}},
    "spec": {
        "successPolicy": "AllWorkers",
        "runPolicy": {
            "cleanPodPolicy": "None",
            "backoffLimit": 3,
            "schedulingPolicy": {"minAvailable": 3},
        },
        "tfReplicaSpecs": {
            "Master": {
                "replicas": 1,
                "template": {"spec": {"containers": [{"name": "tensorflow", "image": "tf:2"}]}},
            },
            "Worker": {
                "replicas": 2,
                "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [{"name": "tensorflow", "image": "tf:2"}]}},
            },
        },
    },
}


def test_a_tfjob_becomes_a_trainingjob_by_renames_and_keeps_kubeflows_defaults():
    job, notes = tfjob.convert(TFJOB)
    assert (job["apiVersion"], job["kind"]) == ("ringtrain.io/v1alpha1", "TrainingJob")
    assert job["metadata"] == {"name": "mnist", "namespace": "team-a", "labels": {"a": "b"}}
    reps = job["spec"]["replicaSpecs"]
    assert set(reps) == {"Chief", "Worker"}
    assert reps["Chief"]["restartPolicy"] == "Never"  # TFJob's default, not ringtrain's
    assert reps["Worker"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["runPolicy"] == {
        "cleanPodPolicy": "None",
        "backoffLimit": 3,
        "successPolicy": "AllWorkers",
    }
    said = "; ".join(notes)
    assert "spec.tfReplicaSpecs.Master -> spec.replicaSpecs.Chief" in said
    assert "spec.runPolicy.schedulingPolicy: left out" in said
    loaded = spec.load(job)  # a valid TrainingJob: the operator runs it
    assert [(r.role, r.replicas) for r in loaded.replicas] == [("chief", 1), ("worker", 2)]
    assert loaded.run_policy.success_policy == "AllWorkers"


def test_render_takes_a_tfjob_file_and_says_it_converted_it(tmp_path):
    path = tmp_path / "tfjob.yaml"
    path.write_text(yaml.safe_dump(TFJOB))
    out = ringtrain("render", str(path))
    assert out.returncode == 0, out.stderr
    assert "converted: kubeflow.org/v1 TFJob -> ringtrain.io/v1alpha1 TrainingJob" in out.stderr
    pods = [o for o in yaml.safe_load_all(out.stdout) if o and o["kind"] == "Pod"]
    assert sorted(p["metadata"]["name"] for p in pods) == [
        "mnist-chief-0",
        "mnist-worker-0",
        "mnist-worker-1",
    ]


def test_convert_prints_the_trainingjob(tmp_path):
    path = tmp_path / "tfjob.yaml"
    path.write_text(yaml.safe_dump(TFJOB))
    out = ringtrain("convert", str(path))
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == tfjob.convert(TFJOB)[0]


def test_run_reads_a_tfjob_file_as_its_trainingjob(tmp_path, capsys):
    from ringtrain_localrun import plan

    path = tmp_path / "tfjob.yaml"
    path.write_text(yaml.safe_dump(TFJOB))
    assert plan.read_job(str(path)) == tfjob.convert(TFJOB)[0]
    assert "ringtrain run: " in capsys.readouterr().err
