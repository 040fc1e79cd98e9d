"""The Python client and the job verbs against the real local cluster (issue 36): a compiled
Keras model and numpy arrays go to two worker pods through ConfigMaps the client creates, the
job is followed (`ringtrain logs -f`), waited for, listed and deleted with everything it made;
a job whose data the worker refuses makes ``wait()`` raise with the worker's own message."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from support.procs import CLI, ringtrain

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
    ),
]


@pytest.fixture
def storage_class(kubectl, namespace):
    """A StorageClass with two static hostPath volumes (the local cluster has no provisioner;
    kind's would make one per claim), world-writable as the trainer's UID needs."""
    name = f"rt-{namespace}"[:60]
    hosts = [Path(tempfile.mkdtemp(prefix="ringtrain-pv-", dir="/var/tmp")) for _ in range(2)]
    volumes = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{name}-{i}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": name,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(host), "type": "Directory"},
            },
        }
        for i, host in enumerate(hosts)
    ]
    for host in hosts:
        host.chmod(0o777)
    kubectl.apply(
        [
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": name},
                "provisioner": "kubernetes.io/no-provisioner",
            },
            *volumes,
        ],
        None,
    )
    try:
        yield name, hosts
    finally:
        for v in volumes:
            kubectl("delete", "pv", v["metadata"]["name"], "--wait=false", check=False)
        kubectl("delete", "storageclass", name, check=False)
        for host in hosts:
            shutil.rmtree(host, ignore_errors=True)


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def _model():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ],
        name="mlp",
    )
    m.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def _spec(image: str) -> dict:
    """The project's image (imported into the cluster, never pulled); pods kept to read logs."""
    container = {
        "name": "ringtrain",
        "image": image,
        "imagePullPolicy": "Never",
        "resources": {"requests": {"cpu": "10m"}},
    }
    return {
        "replicaSpecs": {"Worker": {"template": {"spec": {"containers": [container]}}}},
        "runPolicy": {"cleanPodPolicy": "None", "activeDeadlineSeconds": 600},
    }


def _cli(kubeconfig: str, namespace: str, *args: str, timeout_s: float = 120):
    return ringtrain(
        *args,
        "--backend",
        "kubernetes",
        "-n",
        namespace,
        "--kubeconfig",
        kubeconfig,
        timeout_s=timeout_s,
    )


def test_the_client_trains_follows_waits_fetches_lists_and_deletes_a_cluster_job(
    kubeconfig, kubectl, namespace, operator, project_image, storage_class
):
    from ringtrain_client import TrainerClient

    t0 = time.monotonic()
    sc, hosts = storage_class
    client = TrainerClient(
        "kubernetes", namespace=namespace, kubeconfig=kubeconfig, storage_class=sc
    )
    x, y = _data(512, 0)
    xt, yt = _data(256, 1)
    job = client.fit(
        _model(),
        x,
        y,
        validation_data=(xt, yt),
        steps=30,
        batch_size=64,
        workers=2,
        spec=_spec(project_image),
        name="client-mlp",
    )
    follow = subprocess.Popen(
        [
            *CLI,
            "logs",
            job.name,
            "-f",
            "--backend",
            "kubernetes",
            "-n",
            namespace,
            "--kubeconfig",
            kubeconfig,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    st = job.wait(timeout=400)
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    assert st.phase == "Succeeded" and st.step == 30, st
    assert st.test_accuracy is not None and st.test_accuracy > 0.8, st
    # both workers' output, each line named by its pod, the chief's to its final summary
    lines = out.splitlines()
    assert {ln.split("|")[0].strip() for ln in lines} == {"worker-0", "worker-1"}, out[-3000:]
    chief = [ln.split("| ", 1)[1] for ln in lines if ln.startswith("worker-0 ")]
    events = [json.loads(ln) for ln in chief if ln.startswith("{")]
    assert any(e.get("test_accuracy") == st.test_accuracy for e in events), chief[-10:]

    # the export outlived the pods on the job's claim; a reader pod brings it back to Keras
    assert [h for h in hosts if (h / "model.keras").is_file()]
    trained = job.model()
    evaluated = trained.evaluate(xt, yt, return_dict=True, verbose=0)
    assert abs(evaluated["accuracy"] - st.test_accuracy) <= 1 / len(yt) + 1e-6, evaluated
    assert job.model().get_weights()[0].tobytes() == trained.get_weights()[0].tobytes()

    history = job.metrics().history
    assert history["loss"] and history["test_accuracy"][-1] == pytest.approx(st.test_accuracy)

    status = _cli(kubeconfig, namespace, "status", job.name, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["test_accuracy"] == st.test_accuracy
    listed = _cli(kubeconfig, namespace, "list", "--json")
    assert [j["name"] for j in json.loads(listed.stdout)] == [job.name]
    one = _cli(kubeconfig, namespace, "logs", job.name, "--replica", "worker-1")
    assert one.returncode == 0 and one.stdout and "| " not in one.stdout.splitlines()[0]

    # the ConfigMaps the client made are the job's: deleting it removes them
    made = kubectl(
        "get", "configmap", "-n", namespace, "-l", f"ringtrain.io/job-name={job.name}", "-o", "name"
    ).stdout.split()
    assert sorted(made) == ["configmap/client-mlp-data", "configmap/client-mlp-model"]
    claim = kubectl("get", "pvc", "client-mlp-output", "-n", namespace, "-o", "json").stdout
    assert json.loads(claim)["spec"]["storageClassName"] == sc
    deleted = _cli(kubeconfig, namespace, "delete", job.name)
    assert deleted.returncode == 0, deleted.stderr
    deadline = time.monotonic() + 120
    while kubectl(
        "get",
        "configmap,pod,pvc",
        "-n",
        namespace,
        "-l",
        f"ringtrain.io/job-name={job.name}",
        "-o",
        "name",
    ).stdout.strip():
        assert time.monotonic() < deadline, "the job's ConfigMaps and pods outlived it"
        time.sleep(1)
    gone = _cli(kubeconfig, namespace, "status", job.name)
    assert gone.returncode == 2 and "no TrainingJob client-mlp" in gone.stderr
    print(json.dumps({"client_cluster_job_s": round(time.monotonic() - t0, 1)}))


def test_a_refused_job_on_the_cluster_raises_with_the_workers_message(
    kubeconfig, namespace, operator, project_image
):
    from ringtrain_client import JobFailed, TrainerClient

    client = TrainerClient("kubernetes", namespace=namespace, kubeconfig=kubeconfig)
    x, _ = _data(128, 0)
    bad = np.full(len(x), 7, np.int64)  # class 7 of a 2-class softmax
    job = client.fit(
        _model(),
        x,
        bad,
        validation_data=(x, bad),
        steps=5,
        batch_size=32,
        spec=_spec(project_image),
        name="client-bad",
    )
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=300)
    assert failed.value.reason == "TrainingJobFailed"
    assert "y_train" in (failed.value.message or ""), failed.value.message
    waited = _cli(kubeconfig, namespace, "wait", job.name)
    assert waited.returncode == 1 and "y_train" in waited.stdout, waited.stdout


def test_the_tutorial_notebooks_cell_trains_on_the_cluster_in_a_real_kernel(
    kubeconfig, namespace, operator, project_image, storage_class, tmp_path, monkeypatch
):
    """docs/tutorial.ipynb's training cell with the cluster's arguments added — the backend, its
    namespace, kubeconfig and storage class, and the project's image — run by nbclient in a
    real kernel: the job's accuracy and Keras' evaluate of the model read back from the
    cluster agree, as they do locally (tests/local/test_tutorial_notebook.py)."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    nb = nbformat.read(Path(__file__).resolve().parents[2] / "docs" / "tutorial.ipynb", 4)
    train = next(c for c in nb.cells if c.get("id") == "train")
    call = "fit(model, x, y, "
    assert train.source.count(call) == 1 and len(train.source.splitlines()) <= 10
    cluster = {
        "backend": "kubernetes",
        "namespace": namespace,
        "kubeconfig": kubeconfig,
        "storage_class": storage_class[0],
        "spec": _spec(project_image),
    }
    train.source = train.source.replace(call, f"{call}**CLUSTER, ")
    nb.cells.insert(
        nb.cells.index(train), nbformat.v4.new_code_cell(f"CLUSTER = {cluster!r}", id="cluster")
    )
    NotebookClient(
        nb, kernel_name="python3", timeout=400, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    out = "".join(o.get("text", "") for o in train.outputs if o["output_type"] == "stream")
    printed = dict(re.findall(r"^(the job's test accuracy|Keras' evaluate) +([0-9.]+)$", out, re.M))
    job_acc, keras_acc = (
        float(printed["the job's test accuracy"]),
        float(printed["Keras' evaluate"]),
    )
    assert job_acc > 0.8 and abs(keras_acc - job_acc) <= 1 / 256 + 1e-6, printed
    check = next(c for c in nb.cells if c.get("id") == "check")
    assert "agree within one row of 256" in "".join(o.get("text", "") for o in check.outputs)


def test_inputs_over_a_configmaps_size_are_copied_onto_a_claim_before_the_job_starts(
    kubeconfig, kubectl, namespace, operator, project_image, storage_class
):
    """1.3 MB of training data, over a ConfigMap's 1 MiB: refused where no storage class is
    known (nothing created), else copied in ConfigMap parts onto the job's input claim by a
    writer pod while the job is suspended; the job then trains from the claim."""
    from ringtrain_client import TrainerClient

    x, y = _data(40_000, 0)
    xt, yt = _data(256, 1)

    def fit(client: TrainerClient, steps: int):
        return client.fit(
            _model(),
            x,
            y,
            validation_data=(xt, yt),
            steps=steps,
            batch_size=64,
            spec=_spec(project_image),
            name="client-big",
        )

    plain = TrainerClient("kubernetes", namespace=namespace, kubeconfig=kubeconfig)
    with pytest.raises(ValueError, match="needs a storage class"):
        fit(plain, 5)
    assert kubectl("get", "tj", "-n", namespace, "-o", "name").stdout.strip() == ""

    client = TrainerClient(
        "kubernetes", namespace=namespace, kubeconfig=kubeconfig, storage_class=storage_class[0]
    )
    t0 = time.monotonic()
    job = fit(client, 20)
    submitted = time.monotonic() - t0
    try:
        st = job.wait(timeout=400)
    except Exception:
        print(kubectl("get", "tj,pod,pvc,pv", "-n", namespace, "-o", "wide").stdout)
        print(kubectl("get", "tj", "client-big", "-n", namespace, "-o", "yaml").stdout)
        print(kubectl("get", "events", "-n", namespace).stdout[-4000:])
        raise
    assert st.phase == "Succeeded" and st.test_accuracy > 0.8, st
    obj = json.loads(kubectl("get", "tj", "client-big", "-n", namespace, "-o", "json").stdout)
    trainer = obj["spec"]["trainer"]
    assert trainer["modelFrom"]["configMap"]["name"] == "client-big-model"  # 10 kB: a ConfigMap
    assert trainer["data"]["volume"]["persistentVolumeClaim"]["claimName"] == "client-big-data"
    assert obj["spec"]["runPolicy"]["suspend"] is False  # resumed once its inputs were in place
    left = kubectl("get", "configmap", "-n", namespace, "-o", "name").stdout.split()
    assert not [c for c in left if "-part-" in c], left  # the parts are gone
    print(json.dumps({"upload_bytes": int(x.nbytes + y.nbytes), "submit_s": round(submitted, 1)}))


def test_submit_creates_the_job_and_the_configmap_beside_it_and_wait_follows_it(
    kubeconfig, kubectl, namespace, operator, project_image, tmp_path
):
    """`ringtrain submit FILE --backend kubernetes`: a manifest holding a ConfigMap and the
    TrainingJob that reads it (the worker's --model from the mounted file) is created as
    `kubectl create -f` would; `ringtrain wait` follows the name it printed to Succeeded."""
    import yaml
    from e2e_support import training_job
    from support.shipped_model import save_trained

    save_trained(tmp_path / "m.keras")
    made = ringtrain("model-configmap", str(tmp_path / "m.keras"), "--name", "sub-model")
    assert made.returncode == 0, made.stderr
    job = training_job(
        "sub", project_image, steps=2, modelFrom={"configMap": {"name": "sub-model"}}
    )
    manifest = tmp_path / "job.yaml"
    manifest.write_text(made.stdout + "---\n" + yaml.safe_dump(job))
    out = _cli(kubeconfig, namespace, "submit", str(manifest), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"submitted": "sub", "backend": "kubernetes"}
    waited = _cli(kubeconfig, namespace, "wait", "sub", "--timeout", "300", timeout_s=330)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    again = _cli(kubeconfig, namespace, "submit", str(manifest))  # it exists: refused, named
    assert again.returncode == 2 and "already exists" in again.stderr, again.stderr
    assert kubectl("get", "configmap", "sub-model", "-n", namespace).returncode == 0
