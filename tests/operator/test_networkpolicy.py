"""The per-job NetworkPolicy, checked by evaluating it: the local cluster's bridge CNI does not
enforce NetworkPolicy, so who may reach which port is decided here by a small evaluator of the
Kubernetes semantics (matchLabels selectors, ingress rules) over the pods' real labels."""

from __future__ import annotations

import kubernetes_validate
import pytest
from fake_kube import FakeKube
from operator_jobs import job, job_obj

from ringtrain_operator import main as operator_main
from ringtrain_operator import manifests, networkpolicy
from ringtrain_operator.reconcile import reconcile

RING, METRICS = manifests.RING_PORT, manifests.METRICS_PORT
RING_DATA = manifests.RING_DATA_PORT
SETTINGS = networkpolicy.Settings(
    operator_namespace="rt",
    operator_pod_labels={"app.kubernetes.io/name": "ringtrain", "app.kubernetes.io/instance": "rt"},
)
NS_LABELS = {
    ns: {networkpolicy.NAMESPACE_NAME_LABEL: ns}
    for ns in ("team-a", "team-b", "monitoring", "rt", "default")
}


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "the evaluator knows matchLabels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def peer_admits(peer: dict, policy_ns: str, src: dict) -> bool:
    """NetworkPolicyPeer: podSelector alone means the policy's namespace."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    if "namespaceSelector" in peer:
        ns_ok = matches(peer["namespaceSelector"], NS_LABELS[src["namespace"]])
    else:
        ns_ok = src["namespace"] == policy_ns
    return ns_ok and matches(peer.get("podSelector", {}), src["labels"])


def admitted(policies: list[dict], src: dict, dst: dict, port: int) -> bool:
    """Is TCP from ``src`` to ``dst``:``port`` allowed (pods as {namespace, labels})?"""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst["namespace"]
        and "Ingress" in p["spec"]["policyTypes"]
        and matches(p["spec"]["podSelector"], dst["labels"])
    ]
    if not selecting:
        return True  # no policy selects the pod: everything is allowed
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports_ok = not rule.get("ports") or any(
                r["port"] == port and r.get("protocol", "TCP") == "TCP" for r in rule["ports"]
            )
            from_ok = not rule.get("from") or any(
                peer_admits(peer, p["metadata"]["namespace"], src) for peer in rule["from"]
            )
            if ports_ok and from_ok:
                return True
    return False


def pod_of(obj: dict) -> dict:
    return {"namespace": obj["metadata"]["namespace"], "labels": obj["metadata"]["labels"]}


@pytest.fixture
def world():
    """Two jobs in team-a, their policies, and the pods around them."""
    a, b = job(name="a", workers=2, chief=1), job(name="b", workers=2)
    policies = [networkpolicy.network_policy(j, SETTINGS) for j in (a, b)]
    pods = {
        "a": [pod_of(p) for p in manifests.pods(a)],
        "b": [pod_of(p) for p in manifests.pods(b)],
    }
    others = {
        "prometheus": {"namespace": "monitoring", "labels": {"app": "prometheus"}},
        "operator": {
            "namespace": "rt",
            "labels": {"app.kubernetes.io/name": "ringtrain", "app.kubernetes.io/instance": "rt"},
        },
        "stranger in team-a": {"namespace": "team-a", "labels": {"app": "notebook"}},
        # Job a's labels, but in another namespace: a podSelector alone is the policy's own.
        "impostor in team-b": {"namespace": "team-b", "labels": manifests.labels(a)},
        "ringtrain-named pod elsewhere": {
            "namespace": "default",
            "labels": dict(SETTINGS.operator_pod_labels),
        },
    }
    return policies, pods, others


@pytest.mark.parametrize("port", [RING, RING_DATA])
def test_the_ring_ports_admit_only_pods_of_the_same_job(world, port):
    """The gRPC ring port and the grpc+tcp side channel beside it."""
    policies, pods, others = world
    for job_name, members in pods.items():
        other = pods["b" if job_name == "a" else "a"]
        for dst in members:
            assert all(admitted(policies, src, dst, port) for src in members)
            assert not any(admitted(policies, src, dst, port) for src in other)
            assert not any(admitted(policies, src, dst, port) for src in others.values())


def test_the_metrics_port_admits_only_the_monitoring_namespace_and_the_operator(world):
    policies, pods, others = world
    allowed = {"prometheus", "operator"}
    for dst in pods["a"] + pods["b"]:
        for who, src in others.items():
            assert admitted(policies, src, dst, METRICS) == (who in allowed), who
        # peers of the job scrape nothing, and no one reaches any other port
        assert not admitted(policies, pods["a"][0], dst, METRICS)
        assert not any(
            admitted(policies, src, dst, 8080) for src in [*others.values(), *pods["a"], *pods["b"]]
        )


def test_pods_of_other_apps_are_not_selected(world):
    policies, _, others = world
    for src in others.values():
        assert admitted(policies, src, others["stranger in team-a"], 12345)


def test_a_job_without_trainer_exposes_only_its_ring_port():
    obj = job_obj(name="stock", trainer=None)
    del obj["spec"]["trainer"]
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {"containers": [{"name": "tf", "image": "tensorflow/tensorflow"}]}
    }
    from ringtrain_operator import spec

    p = networkpolicy.network_policy(spec.load(obj), SETTINGS)
    assert [r["ports"] for r in p["spec"]["ingress"]] == [[{"protocol": "TCP", "port": RING}]]


def test_the_policy_is_owned_by_its_job_and_valid_kubernetes():
    p = networkpolicy.network_policy(job(), SETTINGS)
    assert p["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert p["metadata"]["name"] == "mnist" and p["metadata"]["namespace"] == "team-a"
    for version in ("1.33.0", "1.35.0"):
        kubernetes_validate.validate(p, version, strict=True)


def test_the_operator_creates_the_policy_once_only_when_told():
    without = FakeKube(job_obj(workers=2))
    reconcile(without, "team-a", "mnist", fetch=lambda ip: None)
    assert "NetworkPolicy" not in {kind for kind, _ in without.objects}
    kube = FakeKube(job_obj(workers=2))
    for _ in range(2):  # a second reconcile (a restarted operator) creates nothing new
        reconcile(kube, "team-a", "mnist", fetch=lambda ip: None, network=SETTINGS)
    assert kube.calls.count(("create", "NetworkPolicy/mnist")) == 1
    assert kube.objects[("NetworkPolicy", "mnist")] == networkpolicy.network_policy(
        job(workers=2), SETTINGS
    )


def test_operator_flags_make_the_settings():
    args = operator_main.parse_args(
        [
            "--network-policy",
            "--metrics-namespace-labels=team=observability,tier=infra",
            "--operator-pod-labels=app.kubernetes.io/name=ringtrain,app.kubernetes.io/instance=x",
        ]
    )
    s = operator_main.network_settings(args, "ops")
    assert s == networkpolicy.Settings(
        metrics_namespace_labels={"team": "observability", "tier": "infra"},
        operator_namespace="ops",
        operator_pod_labels={
            "app.kubernetes.io/name": "ringtrain",
            "app.kubernetes.io/instance": "x",
        },
    )
    assert operator_main.network_settings(operator_main.parse_args([]), "ops") is None
    with pytest.raises(SystemExit):
        operator_main.parse_args(["--metrics-namespace-labels=novalue"])
