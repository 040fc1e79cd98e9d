"""Issue 20, "no pod without bounds": a trainer pod's requests and limits come from the
compile-time memory plan (``ringtrain_operator.resources``), unless its template sets them.

On today's main the pods had no ``resources`` at all; checkov's CKV_K8S_10-13 flagged every one
(tests/chart/test_checkov.py runs the scanner itself)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
from operator_jobs import job_obj

from ringtrain_operator import manifests, resources, spec
from ringtrain_trainer import optim, sizing
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.keras import load as keras_model

MI = 1 << 20


def mi(q: str) -> int:
    assert q.endswith("Mi"), q
    return int(q[:-2]) * MI


def trainer_pods(**trainer) -> list[dict]:
    return manifests.pods(spec.load(job_obj(trainer=trainer)))


def test_every_trainer_pod_gets_cpu_and_memory_requests_and_limits():
    for pod in trainer_pods(model="cnn2", batchSize=64, ipusPerWorker=2):
        r = pod["spec"]["containers"][0]["resources"]
        assert set(r) == {"requests", "limits"}
        assert set(r["requests"]) == set(r["limits"]) == {"cpu", "memory"}
        assert mi(r["requests"]["memory"]) <= mi(r["limits"]["memory"])
        assert r["requests"]["cpu"] == "500m"  # a quarter core per IPU
        assert r["limits"]["cpu"] == "5"  # 2 threads per IPU, one for the ring and the data


@pytest.mark.parametrize(
    ("model", "optimizer", "on_host", "ipus"),
    [("cnn", "adam", True, 1), ("cnn2", "momentum", False, 2), ("cnn", None, True, 4)],
)
def test_the_ipu_part_is_the_plan_the_worker_compiles(model, optimizer, on_host, ipus):
    """The operator's arithmetic equals what the real IPU plans for the same program."""
    trainer = {"model": model, "batchSize": 64, "ipusPerWorker": ipus, "variablesOnHost": on_host}
    if optimizer:
        trainer["optimizer"] = optimizer
    t = spec.load(job_obj(trainer=trainer)).trainer
    m = keras_model.load(model)
    slots = sizing.slots(optimizer)
    state = slots * m.num_params * 4
    ipu = IPU(
        m,
        IPUConfig(
            memory_bytes=t.ipu_memory_mb * MB,
            variables_on_host=on_host,
            replicas=ipus,
            host_threads=1,
            optimizer_state_bytes=0 if on_host else state,
        ),
        m.init(0),
        m.init(0) * 0,
    )
    try:
        planned = ipu.plan(64 // ipus, True).total
    finally:
        ipu.close()
    e = resources.estimate(t)
    assert e["ipu"] == ipus * planned
    assert e["ipu_capacity"] == ipus * 900 * MI
    host_state = state if on_host else 0
    assert e["host"] == m.num_params * 4 * resources.HOST_COPIES + host_state
    if optimizer:
        assert slots * m.num_params * 4 == optim.state_bytes_for(optimizer, m.num_params)
    r = resources.derive(t)
    host = e["base"] + e["host"] + e["ring"] + e["data"]
    assert mi(r["requests"]["memory"]) >= host + e["ipu"] > mi(r["requests"]["memory"]) - MI
    assert mi(r["limits"]["memory"]) >= host * 3 // 2 + ipus * 900 * MI


def test_an_inline_model_is_planned_and_a_model_file_counts_at_capacity():
    inline = keras_model.preset_config("cnn")
    planned = resources.estimate(spec.load(job_obj(trainer={"model": inline})).trainer)
    preset = resources.estimate(spec.load(job_obj(trainer={"model": "cnn"})).trainer)
    assert planned["ipu"] == preset["ipu"] < 64 * MI
    t = spec.load(job_obj(trainer={"model": "/models/net.keras", "ipuMemoryMB": 300})).trainer
    assert resources.estimate(t)["ipu"] == 300 * MI  # the file is the pod's: unknown here


def test_the_data_set_and_the_buckets_count():
    fashion = resources.estimate(spec.load(job_obj(trainer={"bucketMB": 4})).trainer)
    small = resources.estimate(spec.load(job_obj(trainer={"dataset": "mnist-5k"})).trainer)
    assert fashion["data"] == resources.DATASET_BYTES["fashion-mnist"] > 100 * MI
    assert small["data"] == resources.DATASET_BYTES["mnist-5k"]
    assert fashion["ring"] == 8 * MI + resources.RING_SLOT_BYTES
    assert small["ring"] == 50 * MI + resources.RING_SLOT_BYTES


def test_template_resources_are_kept_exactly():
    """The template's owner chose: nothing is added, not even what they left out (a derived
    request could exceed a limit they set, which the API server refuses)."""
    obj = job_obj(trainer={"model": "cnn"})
    given = {"requests": {"cpu": "10m"}}
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {"containers": [{"name": "ringtrain", "resources": given}]}
    }
    for pod in manifests.pods(spec.load(obj)):
        assert pod["spec"]["containers"][0]["resources"] == given


def test_a_stock_job_gets_no_invented_resources():
    """No spec.trainer: the tenant's own program, whose needs the operator cannot know."""
    obj = job_obj()
    obj["spec"].pop("trainer", None)
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {"containers": [{"name": "tf", "image": "tensorflow/tensorflow:2.21.0"}]}
    }
    for pod in manifests.pods(spec.load(obj)):
        assert "resources" not in pod["spec"]["containers"][0]


def test_a_real_worker_stays_within_its_derived_memory_request():
    """The request is the estimate the scheduler places the pod by: a real ``ringtrain
    worker`` (cnn on mnist-5k, 30 steps, a checkpoint) peaks below it (VmHWM of its process:
    measured 173 MB against a 327Mi request)."""
    t = spec.load(job_obj(trainer={"dataset": "mnist-5k", "batchSize": 32})).trainer
    request = mi(resources.derive(t)["requests"]["memory"])
    code = (
        "import sys\nfrom ringtrain.cli import main\nrc = main(sys.argv[1:])\n"
        "hwm = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:'))\n"
        "print('PEAK', int(hwm.split()[1]) * 1024, flush=True)\nsys.exit(rc)\n"
    )
    with tempfile.TemporaryDirectory() as ckpt:
        out = subprocess.run(
            [
                *(sys.executable, "-c", code, "worker", "--model", "cnn", "--dataset", "mnist-5k"),
                *("--steps", "30", "--batch-size", "32", "--checkpoint-dir", ckpt, "--json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.rsplit("PEAK ", 1)[1])
    assert 0 < peak < request, (peak, request)
