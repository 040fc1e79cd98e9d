"""spec.elasticPolicy at admission, and the job at another worker count (decision 0213)."""

from __future__ import annotations

import copy

import pytest
from operator_jobs import job_obj
from test_admission import refused_everywhere

from ringtrain.errors import InvalidSpec
from ringtrain_operator import admission, elastic, spec
from ringtrain_operator.job import ElasticPolicy


def elastic_obj(workers: int = 2, batch: int = 6, **policy) -> dict:
    return job_obj(
        workers=workers,
        trainer={"dataset": "mnist-5k", "steps": 20, "batchSize": batch},
        elasticPolicy=policy,
    )


def test_a_policy_is_typed_with_the_global_batch_it_keeps():
    j = spec.load(elastic_obj(minReplicas=1, maxReplicas=4, maxRestarts=2))
    assert j.elastic == ElasticPolicy(1, 4, 2, 12)
    assert j.run_policy.backoff_limit == 2  # the stricter of backoffLimit 6 and maxRestarts 2


def test_without_a_policy_a_job_is_not_elastic():
    assert spec.load(job_obj()).elastic is None


def test_absent_bounds_are_the_worker_count():
    assert spec.load(elastic_obj(workers=3, batch=4)).elastic == ElasticPolicy(3, 3, None, 12)


def test_min_above_max_is_refused_naming_the_field(tmp_path):
    msg = refused_everywhere(
        elastic_obj(minReplicas=3, maxReplicas=2),
        tmp_path,
        "spec.elasticPolicy.minReplicas: 3 is more than maxReplicas 2",
    )
    assert msg


@pytest.mark.parametrize("workers", [1, 5])
def test_replicas_outside_the_bounds_are_refused_naming_the_field(workers):
    with pytest.raises(InvalidSpec) as e:
        spec.load(elastic_obj(workers=workers, batch=12, minReplicas=2, maxReplicas=4))
    assert str(e.value) == (
        f"spec.replicaSpecs.Worker.replicas: {workers} is outside spec.elasticPolicy's "
        "[minReplicas, maxReplicas] = [2, 4]"
    )


def test_a_global_batch_some_size_cannot_share_is_refused_naming_the_sizes_that_work(tmp_path):
    msg = refused_everywhere(
        elastic_obj(workers=2, batch=6, minReplicas=1, maxReplicas=5),
        tmp_path,
        "global batch 12",
    )
    assert msg == (
        "spec.elasticPolicy: the global batch 12 (spec.trainer.batchSize 6 x 2 Worker.replicas) "
        "is kept across resizes but does not divide evenly among 5 workers; of [1, 5] the sizes "
        "that work: 1, 2, 3, 4. Narrow [minReplicas, maxReplicas] to them, or make the global "
        "batch 60, which every size divides"
    )


def test_micro_batches_and_ipus_count_in_what_divides():
    """K=2 micro-batches on 2 IPUs: a worker's batch must be a multiple of 2 per IPU share, so
    the global batch 16 (4 x 2 workers x K 2) gives 3 workers nothing even."""
    obj = elastic_obj(workers=2, batch=4, minReplicas=1, maxReplicas=4)
    obj["spec"]["trainer"].update(gradientAccumulationSteps=2, ipusPerWorker=2)
    with pytest.raises(InvalidSpec) as e:
        spec.load(obj)
    assert "global batch 16" in str(e.value)
    assert "(a multiple of 4 per worker) among 3 workers" in str(e.value)
    assert "the sizes that work: 1, 2, 4" in str(e.value)
    assert elastic.sizes_that_work(16, range(1, 5), 4) == [1, 2, 4]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"chief": 1}, r"spec.replicaSpecs.Chief: an elastic job's ring is its Workers"),
        ({"mpi": {}}, r"spec.elasticPolicy: an MPI job's world is mpirun's"),
    ],
)
def test_what_cannot_resize_is_refused(extra, match):
    obj = elastic_obj(minReplicas=1, maxReplicas=2)
    if "chief" in extra:
        obj["spec"]["replicaSpecs"]["Chief"] = {"replicas": 1}
    else:
        obj["spec"].update(extra)
    with pytest.raises(InvalidSpec, match=match):
        spec.load(obj)


def test_the_largest_worker_batch_at_min_replicas_must_fit_the_ipu(tmp_path):
    """2 workers x 512 fit 20 MB; 1 worker x 1024 (the same global batch) does not."""

    def obj(lo: int) -> dict:
        o = elastic_obj(workers=2, batch=512, minReplicas=lo, maxReplicas=2)
        o["spec"]["trainer"]["ipuMemoryMB"] = 20
        return o

    assert admission.load(obj(2)).elastic == ElasticPolicy(2, 2, None, 1024)
    msg = refused_everywhere(obj(1), tmp_path, "at minReplicas 1")
    assert msg.startswith(
        "spec.elasticPolicy.minReplicas: at minReplicas 1 a worker's batch is 1024, which cannot "
        "run: model: 28,139,600 bytes needed per IPU at least"
    )


def test_the_schema_refuses_a_bound_below_one():
    with pytest.raises(InvalidSpec, match=r"spec\.elasticPolicy\.minReplicas"):
        spec.load(elastic_obj(minReplicas=0, maxReplicas=2))


def test_resized_keeps_the_global_batch_and_is_admitted_as_it_was():
    obj = elastic_obj(minReplicas=1, maxReplicas=4)
    before = copy.deepcopy(obj)
    j = spec.load(obj)
    three = elastic.resized(obj, j.elastic, 3)
    assert obj == before  # untouched
    assert three["spec"]["replicaSpecs"]["Worker"]["replicas"] == 3
    assert three["spec"]["trainer"]["batchSize"] == 4
    j3 = spec.load(three)
    assert j3.elastic == j.elastic and j3.trainer.batch_size == 4
    assert spec.load(elastic.resized(three, j3.elastic, 2)).trainer.batch_size == 6


def test_resizing_outside_the_policy_or_without_one_is_refused():
    j = spec.load(elastic_obj(minReplicas=1, maxReplicas=3))
    with pytest.raises(InvalidSpec, match=r"4 is outside .* = \[1, 3\]"):
        elastic.resized(elastic_obj(), j.elastic, 4)
    with pytest.raises(InvalidSpec, match=r"spec\.elasticPolicy: not set"):
        elastic.resized(job_obj(), None, 3)
