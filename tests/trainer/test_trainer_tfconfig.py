"""TF_CONFIG parsing and building, as TensorFlow's TFConfigClusterResolver reads it."""

import json

import pytest

from ringtrain import cluster
from ringtrain.cluster import InvalidClusterSpec

SEEDS = (
    '{"cluster":{"worker":["localhost:3737","localhost:3738"]},"task":{"type":"worker","index":1}}'
)


def test_seeds_local_example_parses_to_rank_and_ring():
    spec = cluster.parse(SEEDS)
    assert spec.ring == ("localhost:3737", "localhost:3738")
    assert (spec.rank, spec.world_size, spec.is_chief) == (1, 2, False)
    assert spec.address == "localhost:3738"


def test_absent_tf_config_is_a_single_worker():
    for text in (None, "", "  "):
        spec = cluster.parse(text)
        assert (spec.rank, spec.world_size, spec.is_chief, spec.address) == (0, 1, True, None)


def test_chief_is_rank_zero_and_workers_follow():
    doc = {
        "cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]},
        "task": {"type": "worker", "index": 1},
    }
    spec = cluster.parse(json.dumps(doc))
    assert spec.ring == ("c:1", "w0:1", "w1:1")
    assert spec.rank == 2 and spec.world_size == 3 and not spec.is_chief
    chief = cluster.parse(json.dumps({**doc, "task": {"type": "chief", "index": 0}}))
    assert chief.rank == 0 and chief.is_chief


def test_build_matches_kubeflow_byte_for_byte():
    text = cluster.build(
        {"worker": ["a:2222", "b:2222"], "chief": ["c:2222"], "ps": []}, "worker", 1
    )
    assert text == (
        '{"cluster":{"chief":["c:2222"],"worker":["a:2222","b:2222"]},'
        '"task":{"type":"worker","index":1},"environment":"cloud"}'
    )
    assert cluster.parse(text).to_json() == text


def test_index_map_form_is_accepted():
    spec = cluster.parse(
        '{"cluster":{"worker":{"1":"b:1","0":"a:1"}},"task":{"type":"worker","index":0}}'
    )
    assert spec.ring == ("a:1", "b:1")


@pytest.mark.parametrize(
    "text, field",
    [
        ("{not json", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"cluster":{"gpu":["a:1"]}}', "cluster.gpu"),
        ('{"cluster":{"worker":["a"]},"task":{"type":"worker","index":0}}', "cluster.worker[0]"),
        (
            '{"cluster":{"worker":["a:99999"]},"task":{"type":"worker","index":0}}',
            "cluster.worker[0]",
        ),
        ('{"cluster":{"worker":["a:1"]},"task":{"type":"worker","index":3}}', "task.index"),
        ('{"cluster":{"worker":["a:1"]},"task":{"type":"boss","index":0}}', "task.type"),
        ('{"cluster":{"worker":["a:1"]},"task":{"type":"worker","index":-1}}', "task.index"),
        (
            '{"cluster":{"chief":["a:1","b:1"]},"task":{"type":"chief","index":0}}',
            "at most one chief",
        ),
    ],
)
def test_malformed_tf_config_names_the_field(text, field):
    with pytest.raises(InvalidClusterSpec, match=field.replace("[", r"\[").replace("]", r"\]")):
        cluster.parse(text)


def test_the_evaluator_is_only_in_its_own_task_never_in_cluster():
    """Kubeflow's genClusterSpec and TensorFlow's RunConfig: no evaluator in ``cluster``."""
    text = cluster.build(
        {"chief": ["c:2222"], "worker": ["w0:2222"], "ps": ["p0:2222"], "evaluator": ["e0:2222"]},
        "evaluator",
        0,
    )
    assert json.loads(text) == {
        "cluster": {"chief": ["c:2222"], "worker": ["w0:2222"], "ps": ["p0:2222"]},
        "task": {"type": "evaluator", "index": 0},
        "environment": "cloud",
    }
    ev = cluster.parse(text)
    assert (ev.task_type, ev.in_ring, ev.is_chief, ev.address) == ("evaluator", False, False, None)
    assert ev.ring == ("c:2222", "w0:2222") and ev.world_size == 2
    with pytest.raises(InvalidClusterSpec, match="does not take part in the ring"):
        _ = ev.rank
    chief = cluster.parse(
        cluster.build(
            {"chief": ["c:2222"], "worker": ["w0:2222"], "evaluator": ["e0:2222"]}, "chief", 0
        )
    )
    assert "evaluator" not in chief.cluster and chief.rank == 0 and chief.is_chief


def test_an_evaluator_listed_in_cluster_by_older_tools_still_parses():
    text = (
        '{"cluster":{"worker":["w0:2222"],"evaluator":["e0:2222"]},'
        '"task":{"type":"evaluator","index":0}}'
    )
    assert cluster.parse(text).address == "e0:2222"
