"""Fuzzed TrainingJob specs: one verdict everywhere, a named field, and no harm done.

Specs are valid jobs mutated by ``hypothesis`` (wrong types, negative and huge numbers, missing
and unknown roles, unknown fields, 253-character names, PS replicas beside the built-in trainer).
For each: ``spec.load`` returns a Job or raises InvalidSpec naming a field (never another
exception); ``ringtrain render`` and ``ringtrain run`` (its plan, in process; a few real
subprocesses below) agree; the CRD's server-side schema never accepts less than ``spec.load``
would reject; and the operator's reconcile on the fake API records Failed/InvalidSpec with one
Event, creates nothing, and does nothing more on the next pass.
"""

from __future__ import annotations

import copy
import re
import sys

import jsonschema
import pytest
import yaml
from fake_kube import FakeKube
from hypothesis import given
from hypothesis import strategies as st
from operator_jobs import job_obj
from support.fuzz import fuzz
from support.procs import ringtrain

from ringtrain.errors import InvalidSpec
from ringtrain_localrun.plan import plan
from ringtrain_operator import render, spec, status
from ringtrain_operator.job import API_VERSION
from ringtrain_operator.reconcile import reconcile

FIELD = re.compile(r"\b(spec|metadata|apiVersion|kind)\b")
FUZZ = fuzz(120)


def stock_job() -> dict:
    """A job without spec.trainer running a stock command: ``ringtrain run`` finishes it fast."""
    obj = job_obj(name="stock", workers=1)
    del obj["spec"]["trainer"]
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {
            "containers": [
                {"name": "main", "image": "python:3", "command": [sys.executable, "-c", "pass"]}
            ]
        }
    }
    return obj


BASES = [job_obj(workers=2), job_obj(workers=1, chief=1, evaluator=1), stock_job()]
PATHS = [
    ("spec", "replicaSpecs", "Worker", "replicas"),
    ("spec", "replicaSpecs", "Worker", "restartPolicy"),
    ("spec", "replicaSpecs", "Worker", "template"),
    ("spec", "replicaSpecs", "Worker", "template", "spec", "containers"),
    ("spec", "replicaSpecs"),
    ("spec", "trainer", "batchSize"),
    ("spec", "trainer", "steps"),
    ("spec", "trainer", "epochs"),
    ("spec", "trainer", "ipusPerWorker"),
    ("spec", "trainer", "learningRate"),
    ("spec", "trainer", "dataset"),
    ("spec", "trainer", "checkpoint"),
    ("spec", "trainer", "checkpoint", "everySteps"),
    ("spec", "trainer", "ringTransport"),
    ("spec", "runPolicy", "backoffLimit"),
    ("spec", "runPolicy", "activeDeadlineSeconds"),
    ("spec", "runPolicy", "cleanPodPolicy"),
    ("spec",),
    ("metadata", "namespace"),
    ("metadata",),
    ("apiVersion",),
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.sampled_from([0, -1, 2**31, 2**53 + 1, 10**30]),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
NAMES = st.one_of(
    st.just("a" * 253),
    st.just("a" * 48),
    st.just("a" * 49),
    st.from_regex(r"\A[a-z][-a-z0-9]{0,60}\Z"),
    st.text(max_size=12),
    JUNK,
)
ROLES = st.sampled_from(["PS", "Evaluator", "Chief", "Master", "worker", "Launcher", ""])


def put(obj: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = value


def drop(obj: dict, path: tuple) -> None:
    for key in path[:-1]:
        obj = obj.get(key)
        if not isinstance(obj, dict):
            return
    obj.pop(path[-1], None)


MUTATIONS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(PATHS), JUNK),
    st.tuples(st.just("drop"), st.sampled_from(PATHS), st.none()),
    st.tuples(st.just("unknown"), st.sampled_from(PATHS), st.text(min_size=1, max_size=8)),
    st.tuples(st.just("name"), st.just(("metadata", "name")), NAMES),
    st.tuples(st.just("role"), ROLES, st.one_of(st.integers(-3, 3), JUNK)),
)


@st.composite
def specs(draw) -> dict:
    obj = copy.deepcopy(draw(st.sampled_from(BASES)))
    for kind, where, value in draw(st.lists(MUTATIONS, max_size=3)):
        if kind == "set" or kind == "name":
            put(obj, where, value)
        elif kind == "drop":
            drop(obj, where)
        elif kind == "unknown":
            parent = where[:-1] or ("spec",)
            put(obj, (*parent, value), 1)
        else:  # a role with a replica count, maybe wrong
            put(obj, ("spec", "replicaSpecs", where), {"replicas": value})
    return obj


def verdict(fn, *args) -> str | None:
    """None when accepted, else the InvalidSpec message; any other exception fails the test."""
    try:
        fn(*args)
    except InvalidSpec as e:
        return str(e)
    return None


def server_schema_rejects(obj: dict) -> bool:
    """The API server's verdict, approximated: the CRD schema after defaulting, unknown fields
    pruned (not rejected), as the server does for a structural schema."""
    schema = spec._schema()
    doc = spec.apply_defaults(schema, {k: v for k, v in obj.items() if k != "status"})
    return any(True for _ in jsonschema.Draft4Validator(schema).iter_errors(doc))


@FUZZ
@given(specs())
def test_fuzzed_specs_get_one_verdict_everywhere_and_harm_nothing(tmp_path_factory, obj):
    message = verdict(spec.load, obj)
    if message is not None:
        assert FIELD.search(message), f"no field named in {message!r}"
    # ringtrain render and ringtrain run decide with the same functions: the same verdict.
    assert (verdict(render.render, [obj]) is None) == (message is None)
    run_dir = tmp_path_factory.mktemp("run")
    assert (verdict(plan, obj, run_dir) is None) == (message is None)
    if message is None:
        assert not server_schema_rejects(obj)
    if not isinstance(obj.get("metadata"), dict) or obj.get("apiVersion") != API_VERSION:
        return  # the API server would not even store it under this CRD
    kube = FakeKube(obj)
    name = obj["metadata"].get("name")
    first = reconcile(kube, "team-a", name, fetch=lambda ip: None)
    if message is None:
        pods = [k for k in kube.objects if k[0] == "Pod"]
        assert len(pods) == sum(r.replicas for r in spec.load(obj).replicas)
        return
    assert kube.job["status"]["state"] == status.FAILED
    assert [(e.type, e.reason) for e in first.events] == [("Warning", status.REASON_INVALID)]
    assert kube.objects == {}  # no pod, no Service, no Secret
    kube.calls.clear()
    again = reconcile(kube, "team-a", name, fetch=lambda ip: None)
    assert kube.calls == [] and again.events == ()  # settled: no loop, no repeated Event
    assert first.requeue_after_s is None


def test_a_ps_replica_beside_the_built_in_trainer_gets_one_verdict():
    """The trainer is a pure ring: it has no parameter servers. Whatever spec.load decides
    (another change makes it InvalidSpec), render, run and the operator decide the same."""
    obj = job_obj(workers=2, ps=1)
    message = verdict(spec.load, obj)
    assert (verdict(render.render, [obj]) is None) == (message is None)
    kube = FakeKube(obj)
    reconcile(kube, "team-a", "mnist", fetch=lambda ip: None)
    assert (kube.job["status"]["state"] == status.FAILED) == (message is not None)


def _bad(mutate) -> dict:
    obj = job_obj(workers=2)
    mutate(obj)
    return obj


SAMPLES = {
    "negative replicas": (
        _bad(lambda o: put(o, ("spec", "replicaSpecs", "Worker", "replicas"), -1)),
        "spec.replicaSpecs.Worker.replicas",
    ),
    "string batch size": (
        _bad(lambda o: put(o, ("spec", "trainer", "batchSize"), "32")),
        "spec.trainer.batchSize",
    ),
    "unknown role": (
        _bad(lambda o: put(o, ("spec", "replicaSpecs", "Master"), {"replicas": 1})),
        "Master",
    ),
    "253-character name": (
        _bad(lambda o: put(o, ("metadata", "name"), "a" * 253)),
        "metadata.name",
    ),
    "unknown field": (_bad(lambda o: put(o, ("spec", "trainer", "batchsize"), 32)), "batchsize"),
}


@pytest.mark.parametrize("case", SAMPLES, ids=SAMPLES)
def test_render_and_run_processes_refuse_a_bad_spec_naming_the_field(tmp_path, case):
    obj, field = SAMPLES[case]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(obj))
    assert field in verdict(spec.load, obj)
    for args in (["render", str(path)], ["run", str(path), "--run-dir", str(tmp_path / "r")]):
        p = ringtrain(*args, timeout_s=60)
        assert p.returncode == 2 and field in p.stderr, (args, p.stderr)
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_render_and_run_processes_accept_a_valid_spec(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(stock_job()))
    assert ringtrain("render", str(path), timeout_s=60).returncode == 0
    p = ringtrain("run", str(path), "--run-dir", str(tmp_path / "r"), "--json", timeout_s=120)
    assert p.returncode == 0, p.stderr[-2000:]
