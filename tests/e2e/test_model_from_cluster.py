"""spec.trainer.modelFrom on the real local cluster (decision 0206): a `.keras` file made by real
Keras, put in a ConfigMap by `ringtrain model-configmap` and created with `kubectl create`, is
mounted read-only into both workers by the kubelet and trained from — the job's accuracy after
one step at the file's own learning rate (1e-9) is Keras' accuracy of those weights, which no
other starting point gives. One short job (one step, two workers): about a minute."""

from __future__ import annotations

import json
import time

import pytest
from e2e_support import job_pods, training_job, wait_state
from support.procs import ringtrain
from support.shipped_model import save_trained

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
    ),
]

MOUNTED = "/var/run/ringtrain/model/model.keras"


def test_a_keras_file_in_a_configmap_is_mounted_and_trained_from_on_the_cluster(
    kubectl, namespace, operator, project_image, tmp_path
):
    t0 = time.monotonic()
    accuracy = save_trained(tmp_path / "trained.keras")
    made = ringtrain(
        "model-configmap", str(tmp_path / "trained.keras"), "--name", "shipped-model", timeout_s=60
    )
    assert made.returncode == 0, made.stderr
    # create, as the helper's header says: a client-side apply would copy it into an annotation
    kubectl("create", "-n", namespace, "-f", "-", input=made.stdout)

    kubectl.apply(
        training_job(
            "shipped",
            project_image,
            replicas=2,
            steps=1,
            modelFrom={"configMap": {"name": "shipped-model"}},
            run_policy={"cleanPodPolicy": "None"},  # keep the pods to read their logs
        ),
        namespace,
    )
    job = wait_state(kubectl, namespace, "shipped", "Succeeded", 300, operator.tail)
    progress = job["status"]["progress"]
    assert progress["step"] == 1
    assert progress["testAccuracy"] == pytest.approx(accuracy, abs=1e-9)  # Keras' weights

    pods = {p["metadata"]["name"]: p for p in job_pods(kubectl, namespace, "shipped")}
    assert set(pods) == {"shipped-worker-0", "shipped-worker-1"}
    for name, pod in pods.items():
        (c,) = pod["spec"]["containers"]
        assert c["args"][c["args"].index("--model") + 1] == MOUNTED, name
        mount = next(m for m in c["volumeMounts"] if m["name"] == "ringtrain-model")
        assert mount["mountPath"] == "/var/run/ringtrain/model" and mount["readOnly"] is True
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "ringtrain-model")
        assert volume["configMap"]["name"] == "shipped-model"
    chief = pods["shipped-worker-0"]
    final = json.loads(chief["status"]["containerStatuses"][0]["state"]["terminated"]["message"])
    assert final["test_accuracy"] == progress["testAccuracy"]
    log = kubectl.log("shipped-worker-0", namespace, "ringtrain")
    # the worker runs the mounted file's compile(): SGD at 1e-9, where a preset runs Adam
    assert "optimizer SGD(learning_rate=1e-09" in log and "[model compile_config]" in log, log
    print(f"modelFrom e2e: Keras accuracy {accuracy:.4f}, {time.monotonic() - t0:.1f} s")
