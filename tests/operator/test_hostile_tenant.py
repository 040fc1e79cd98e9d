"""Issue 20, the operator's side: one tenant's spec must not cost the operator (every tenant's)
its memory, nor loop its reconciles. Each test reproduces a case that failed before the fix.

Memory is measured in a fresh process (``VmHWM`` of a ``python`` that only imports the operator
and loads the spec), so the peak is the check's own, not the test runner's: ``ru_maxrss`` would
not do, Linux carries it across exec from the parent that spawned the process (seen: 879 MiB in
a full test run for an 82 MiB check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_kube import FakeKube
from operator_jobs import job_obj

from ringtrain import options
from ringtrain.errors import InvalidSpec
from ringtrain_operator import spec, status
from ringtrain_operator.reconcile import reconcile

#: the chart's memory limit for the operator is 256Mi
PEAK_LIMIT_MIB = 256
#: what checking a hostile model may add to checking a spec of the same kind (VmHWM): a refused
#: 7.95e12-parameter Dense adds nothing; the largest admitted model (7e9 parameters, 52 GiB) adds
#: 35 MiB over a 10-unit one (47 MiB), bounded by the CRD's ipuMemoryMB maximum
EXTRA_LIMIT_MIB = 64


def sequential(input_shape: list[int], *layers: dict) -> dict:
    return {
        "class_name": "Sequential",
        "config": {
            "name": "hostile",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_shape": [None, *input_shape]}},
                *layers,
            ],
        },
    }


def layer(cls: str, **config) -> dict:
    return {"class_name": cls, "config": config}


#: the issue's 2 KB spec: Dense(units: 1e10) (a JSON number the API server stores as an int)
HUGE_DENSE = sequential(
    [28, 28, 1], layer("Flatten"), layer("Dense", units=10**10), layer("Dense", units=10)
)


def load_in_a_fresh_process(trainer: dict) -> dict:
    """spec.load of a job with this spec.trainer in a new interpreter: its verdict, the
    seconds the load took and the process's peak RSS in MiB."""
    code = """
import json, sys, time
from ringtrain_operator import spec
obj = json.loads(sys.stdin.read())
t = time.perf_counter()
try:
    spec.load(obj)
    verdict = None
except spec.InvalidSpec as e:
    verdict = str(e)
took = time.perf_counter() - t
hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
peak = int(hwm.split()[1]) / 1024
print(json.dumps({"verdict": verdict, "seconds": took, "peak_mib": peak}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(job_obj(trainer=trainer)),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_huge_inline_dense_is_refused_by_arithmetic_with_the_numbers_in_little_memory():
    """Before: accepted after building the model, 578 MiB peak (the chart allows 256Mi)."""
    got = load_in_a_fresh_process({"model": HUGE_DENSE, "dataset": "mnist-5k", "steps": 1})
    assert got["verdict"] is not None
    assert "spec.trainer.model" in got["verdict"] and "ipuMemoryMB" in got["verdict"]
    assert "7,950,000,000,010 parameters" in got["verdict"]
    base = load_in_a_fresh_process({"dataset": "mnist-5k", "steps": 1})
    assert got["peak_mib"] < PEAK_LIMIT_MIB and got["peak_mib"] - base["peak_mib"] < EXTRA_LIMIT_MIB
    print(json.dumps({"case": "huge_dense_refused", "baseline_peak_mib": base["peak_mib"], **got}))


def test_a_huge_dense_behind_a_free_input_dimension_is_refused_by_its_weights_alone():
    """Before: a free (None) input dimension skipped the budget and the spec check built the
    model — a 966-byte spec took 18.6 s and 802 MiB (issue 35). The weights do not depend on
    the free dimension, so they are held to the budget by arithmetic."""
    free = sequential([None, 28], layer("GlobalAveragePooling1D"), layer("Dense", units=10**10))
    got = load_in_a_fresh_process({"model": free, "dataset": "mnist-5k", "steps": 1})
    assert got["verdict"] is not None and "spec.trainer.model" in got["verdict"]
    assert "290,000,000,000 parameters" in got["verdict"] and "ipuMemoryMB" in got["verdict"]
    assert got["seconds"] < 5
    base = load_in_a_fresh_process({"dataset": "mnist-5k", "steps": 1})
    assert got["peak_mib"] < PEAK_LIMIT_MIB and got["peak_mib"] - base["peak_mib"] < EXTRA_LIMIT_MIB
    print(
        json.dumps({"case": "free_dim_dense_refused", "baseline_peak_mib": base["peak_mib"], **got})
    )


def test_the_largest_model_the_budget_admits_is_checked_in_little_memory():
    """At the CRD's largest ipuMemoryMB, a model just inside the budget is built (to check its
    shapes as the worker will) in bounded memory: the budget bounds the build."""
    top = options.BY_NAME["ipu_memory_mb"].maximum
    near = sequential([700_000_000], layer("Dense", units=10))  # 7e9 parameters, 52 GiB
    got = load_in_a_fresh_process(
        {"model": near, "dataset": "mnist-5k", "steps": 1, "ipuMemoryMB": top, "batchSize": 1}
    )
    assert got["verdict"] is None
    # the baseline parses an inline model too (same imports), only a tiny one
    tiny = sequential([10], layer("Dense", units=10))
    base = load_in_a_fresh_process({"model": tiny, "dataset": "mnist-5k", "steps": 1})
    assert got["peak_mib"] < PEAK_LIMIT_MIB and got["peak_mib"] - base["peak_mib"] < EXTRA_LIMIT_MIB
    print(
        json.dumps({"case": "largest_admitted_model", "baseline_peak_mib": base["peak_mib"], **got})
    )


def test_a_model_that_fits_is_accepted_and_one_byte_less_is_refused():
    """The budget is arithmetic on shapes: weights and gradients (8 bytes a parameter), the
    input and the largest activation for the per-IPU batch."""
    model = sequential([1024], layer("Dense", units=256), layer("Dense", units=10))
    params = 1024 * 256 + 256 + 256 * 10 + 10
    need = 8 * params + 4 * 2 * (1024 + 256)  # batch 4 on 2 IPUs: 2 examples per IPU
    trainer = {"model": model, "batchSize": 4, "ipusPerWorker": 2}
    assert spec.model_error(model, (need, 2)) is None
    assert "bytes needed per IPU" in spec.model_error(model, (need - 1, 2))
    spec.load(job_obj(trainer={**trainer, "ipuMemoryMB": 3}))


@pytest.mark.parametrize(
    "bad",
    [
        layer("MaxPooling2D", pool_size=[2, 2], strides=[0, 0]),
        layer("AveragePooling2D", strides=0),
        layer("MaxPooling2D", strides=[-1, 2]),
    ],
)
def test_pooling_strides_below_one_are_invalid_spec_and_one_event_not_a_retry_loop(bad):
    """Before: ZeroDivisionError out of spec.load at every reconcile, retried every 5 s."""
    model = sequential([8, 8, 1], bad, layer("Flatten"), layer("Dense", units=2))
    with pytest.raises(InvalidSpec, match="strides"):
        spec.load(job_obj(trainer={"model": model}))
    kube = FakeKube(job_obj(trainer={"model": model}))
    first = reconcile(kube, "team-a", "mnist", fetch=lambda ip: None)
    assert kube.job["status"]["state"] == status.FAILED
    assert [(e.type, e.reason) for e in first.events] == [("Warning", status.REASON_INVALID)]
    assert kube.objects == {}
    kube.calls.clear()
    again = reconcile(kube, "team-a", "mnist", fetch=lambda ip: None)
    assert kube.calls == [] and again.events == ()


def test_a_diverged_worker_fails_the_job_as_training_diverged_with_its_own_words():
    """Before: a diverged worker exited 0 and the job Succeeded. Now it exits EXIT_DIVERGED (3,
    permanent) and the fold names the reason and carries the worker's message (bounded)."""
    from operator_jobs import job
    from test_status import cond, pod, running, step

    from ringtrain.errors import EXIT_DIVERGED

    j = job(workers=2)
    prev = step(j, running(j), None).status
    said = "Diverged: step 3 rank 1: training diverged: the reduced gradient of dense/bias[0]"
    log = json.dumps({"event": "error", "error": said + "x" * 5000, "exit_code": EXIT_DIVERGED})
    failed = pod("mnist-worker-1", "Failed", exit_code=EXIT_DIVERGED, message=log)
    d = step(j, running(j, **{"mnist-worker-1": failed}), prev)
    assert d.status["state"] == status.FAILED
    c = cond(d.status, status.FAILED)
    assert c["reason"] == status.REASON_DIVERGED == "TrainingDiverged"
    assert said in c["message"] and len(c["message"]) < 700
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "TrainingDiverged")]


class JsonKube(FakeKube):
    """A FakeKube that stores the job as JSON text, as the API server does: a 500-deep object
    survives it (the C json codec), where FakeKube's own deepcopy would not."""

    def __init__(self, job: dict) -> None:
        super().__init__({})
        self.text = json.dumps(job)

    def get_job(self, namespace: str, name: str) -> dict:
        return {**json.loads(self.text), "status": dict(self.job.get("status") or {})}


def nested(depth: int) -> dict:
    root = cur = {}
    for _ in range(depth):
        cur["x"] = {}
        cur = cur["x"]
    return root


def mounts_job(path: str, **trainer) -> dict:
    obj = job_obj(trainer={"dataset": "mnist-5k", "checkpoint": {"path": path}, **trainer})
    return obj


def with_template_mount(obj: dict, path: str) -> dict:
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {
            "containers": [
                {"name": "ringtrain", "volumeMounts": [{"name": "cfg", "mountPath": path}]}
            ],
            "volumes": [{"name": "cfg", "emptyDir": {}}],
        }
    }
    return obj


def deep_template() -> dict:
    obj = job_obj()
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "metadata": {"annotations": {}},
        "spec": {"containers": [{"name": "ringtrain", "env": [nested(500)]}]},
    }
    return obj


SETTLES = {
    "a pod template nested 500 deep": (deep_template, "nested deeper than 64 levels"),
    "activeDeadlineSeconds 1e14": (
        lambda: job_obj(run_policy={"activeDeadlineSeconds": 10**14}),
        "activeDeadlineSeconds",
    ),
    "ttlSecondsAfterFinished 1e14": (
        lambda: job_obj(run_policy={"ttlSecondsAfterFinished": 10**14}),
        "ttlSecondsAfterFinished",
    ),
    "checkpoint.path on /tmp": (lambda: mounts_job("/tmp/"), "operator's /tmp volume"),
    "checkpoint.path on the token's mount": (
        lambda: mounts_job("/var/run/ringtrain/ring-token"),
        "ring token's volume",
    ),
    "checkpoint.path on the data mount": (
        lambda: mounts_job(
            "/data", data={"volume": {"emptyDir": {}}, "file": "x.npz"}, dataset="fashion-mnist"
        ),
        "spec.trainer.data's volume",
    ),
    "checkpoint.path on a template's mount": (
        lambda: with_template_mount(mounts_job("/ckpt"), "/ckpt"),
        "volume 'cfg' in spec.replicaSpecs.Worker.template",
    ),
    "learningRate 1e308": (lambda: job_obj(trainer={"learningRate": 1e308}), "learningRate"),
    "steps 2^53": (lambda: job_obj(trainer={"steps": 2**53}), "steps"),
}


@pytest.mark.parametrize("case", SETTLES)
def test_specs_that_looped_the_reconcile_settle_as_invalid_spec_with_one_event(case):
    """Before: an exception (RecursionError, OverflowError) or a Pod the API server refused,
    at every reconcile, retried every 5 s forever; or a job that could never end."""
    make, words = SETTLES[case]
    with pytest.raises(InvalidSpec, match=words):
        spec.load(make())
    kube = JsonKube(make())
    first = reconcile(kube, "team-a", "mnist", fetch=lambda ip: None)
    assert kube.job["status"]["state"] == status.FAILED
    assert [(e.type, e.reason) for e in first.events] == [("Warning", status.REASON_INVALID)]
    assert kube.objects == {} and first.requeue_after_s is None
    kube.calls.clear()
    again = reconcile(kube, "team-a", "mnist", fetch=lambda ip: None)
    assert kube.calls == [] and again.events == ()


def test_a_checkpoint_path_of_its_own_is_accepted():
    spec.load(with_template_mount(mounts_job("/ckpt"), "/config"))
    spec.load(mounts_job("/tmp/checkpoints"))  # under another mount is fine: only equal paths
