"""The Helm chart: lint, render, validate every object against Kubernetes' schemas, and check
that what it promises (least privilege, non-root, alerts, dashboard) holds for the real code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from chart_helpers import ALL_ON, CHART, ROOT, by_kind
from prometheus_client import CollectorRegistry
from test_rbac import GRANTS

from ringtrain_operator import main as operator_main
from ringtrain_operator import manifests
from ringtrain_operator.metrics import OperatorMetrics
from ringtrain_trainer.telemetry.metrics import TrainerMetrics

#: Kubernetes minor versions whose schemas the rendered objects must satisfy: the releases kind
#: ships node images for today, and the newest the validator knows.
K8S_VERSIONS = ("1.33.0", "1.34.0", "1.35.0", "1.37.0")
#: Kinds from the Prometheus Operator: no schema offline, checked by the tests below instead.
MONITORING = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
VALUE_SETS = {"defaults": [], "all-on": ALL_ON}
METRIC = re.compile(r"\bringtrain_[a-z0-9_]+\b")


def test_crd_in_chart_is_the_operators_crd():
    """Helm installs crds/; the operator validates with its package copy. They must not drift."""
    chart_crd = CHART / "crds" / "trainingjobs.yaml"
    source = ROOT / "operator" / "ringtrain_operator" / "crd" / "trainingjobs.yaml"
    assert chart_crd.read_bytes() == source.read_bytes(), (
        f"cp {source.relative_to(ROOT)} {chart_crd.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_strict(helm, values):
    out = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_valid_kubernetes(render, values, version):
    objs = render(*values)
    crd = yaml.safe_load((CHART / "crds" / "trainingjobs.yaml").read_text())
    checked = 0
    for obj in [crd, *objs]:
        if obj["kind"] in MONITORING:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} on {version}: {e.message} "
                f"at {list(e.path)}"
            )
        checked += 1
    assert checked >= 5  # CRD, SA, role(s) + binding(s), Service, Deployment


def test_values_schema_rejects_typos_and_bad_types(helm):
    for bad in (
        ["--set", "rbac.clusterscoped=false"],
        ["--set", "metrics.port=http"],
        ["--set", "image.pullPolicy=Sometimes"],
        ["--set", "podSecurityContext.runAsNonRoot=false"],
    ):
        out = subprocess.run(
            [helm, "template", "rt", str(CHART), *bad], capture_output=True, text=True
        )
        assert out.returncode != 0, f"{bad} was accepted"
        assert "values don't meet the specifications of the schema" in out.stderr, out.stderr


def test_optional_objects_follow_their_switches(render):
    assert not {o["kind"] for o in render()} & (MONITORING | {"ConfigMap"})
    kinds = [o["kind"] for o in render(*ALL_ON)]
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} <= set(kinds)


def test_deployment_is_recreate_non_root_read_only_with_liveness(render):
    (dep,) = by_kind(render(), "Deployment")
    spec = dep["spec"]
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][0] == "operator" and "--all-namespaces" in c["args"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    psc = pod["securityContext"]
    # The same UID as the worker pods the operator creates and the image's USER.
    assert psc["runAsUser"] == manifests.RUN_AS_USER == 10001
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["image"] == "ringtrain:0.1.0"  # appVersion, the tag hack/kind loads


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_operator_args_are_accepted_by_the_operators_own_parser(render, values):
    (dep,) = by_kind(render(*values, "--set", "operator.verbose=true"), "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "operator"
    args = operator_main.parse_args(c["args"][1:])
    assert args.listen == f"0.0.0.0:{c['ports'][0]['containerPort']}"
    assert args.verbose is True
    assert args.namespace == ([] if not values else ["team-a", "team-b"])


def test_namespaced_install_watches_only_its_namespaces(render):
    objs = render(*ALL_ON)
    (dep,) = by_kind(objs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert {r["metadata"]["namespace"] for r in by_kind(objs, "Role")} == {"team-a", "team-b"}
    bindings = by_kind(objs, "RoleBinding")
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    for b in by_kind(objs, "RoleBinding"):
        assert b["subjects"][0]["namespace"] == "rt"  # the operator's own account
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert (
        dep["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example.com/ml/ringtrain:0.1.0-rc1"
    )


def _rules(obj: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) → verbs, flattened."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in obj["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                out.setdefault((g, r), set()).update(rule["verbs"])
    return out


#: (apiGroup, resource) → verbs, from test_rbac.GRANTS (which names the code behind each verb).
OPERATOR_NEEDS: dict[tuple[str, str], set[str]] = {}
for _group, _resource, _verb in GRANTS:
    OPERATOR_NEEDS.setdefault((_group, _resource), set()).add(_verb)


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rbac_is_exactly_what_the_operator_needs(render, values):
    objs = render(*values)
    cluster_scoped = not values
    discovery = [
        r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"].endswith("-discovery")
    ]
    if cluster_scoped:
        assert [_rules(d) for d in discovery] == [
            {
                ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
                ("", "namespaces"): {"list", "watch"},
            }
        ]
    main_roles = by_kind(objs, "ClusterRole" if cluster_scoped else "Role")
    main_roles = [r for r in main_roles if not r["metadata"]["name"].endswith("-discovery")]
    assert main_roles
    for role in main_roles:
        assert _rules(role) == OPERATOR_NEEDS
        assert not any("*" in v for v in _rules(role).values())
    if not cluster_scoped:  # nothing cluster-wide: the operator runs with scanning off
        assert by_kind(objs, "ClusterRole") == [] and by_kind(objs, "ClusterRoleBinding") == []


def test_prometheus_rules_pass_promtool_check_and_unit_tests(render, tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `hack/setup test` installs Debian's prometheus package"
    source = CHART / "rules" / "ringtrain.rules.yaml"
    (rule,) = by_kind(render(*ALL_ON), "PrometheusRule")
    # What the chart ships is exactly the checked file.
    assert rule["spec"] == yaml.safe_load(source.read_text())
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run(
        [promtool, "check", "rules", str(source), str(rendered)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tests = tmp_path / "rules_test.yaml"
    tests.write_text(
        (ROOT / "tests" / "chart" / "rules_test.yaml")
        .read_text()
        .replace("[RULES]", json.dumps([str(source)]))
    )
    out = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def exposed_metric_names() -> set[str]:
    """Every sample name the trainer and the operator can expose, from their real registries."""
    names: set[str] = set()
    for make in (TrainerMetrics, OperatorMetrics):
        registry = CollectorRegistry()
        make(registry=registry)
        for family in registry.collect():
            suffixes = {
                "counter": ("_total", "_created"),
                "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"),
            }
            names.add(family.name)
            names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names


def _dashboard() -> dict:
    return json.loads((CHART / "dashboards" / "ringtrain.json").read_text())


def test_dashboard_is_generated_and_queries_only_real_metrics():
    out = subprocess.run(
        [str(ROOT / "hack" / "gen-dashboard"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    dash = _dashboard()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    used = set()
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used.update(METRIC.findall(t["expr"]))
    missing = used - exposed_metric_names()
    assert not missing, f"dashboard queries metrics nobody exposes: {sorted(missing)}"
    # Both components are on it.
    assert any(m.startswith("ringtrain_operator_") for m in used)
    assert any(not m.startswith("ringtrain_operator_") for m in used)


def test_alert_rules_query_only_real_metrics():
    doc = yaml.safe_load((CHART / "rules" / "ringtrain.rules.yaml").read_text())
    used = {m for g in doc["groups"] for r in g["rules"] for m in METRIC.findall(r["expr"])}
    assert used and not used - exposed_metric_names(), sorted(used - exposed_metric_names())


def test_dashboard_configmap_carries_the_sidecar_label_and_the_json(render):
    (cm,) = by_kind(render(*ALL_ON), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ringtrain.json"]) == _dashboard()


def test_podmonitor_relabels_with_the_operators_pod_labels(render):
    (pm,) = by_kind(render(*ALL_ON), "PodMonitor")
    assert pm["spec"]["selector"]["matchExpressions"] == [
        {"key": manifests.LABEL_JOB, "operator": "Exists"}
    ]
    sources = {
        r["sourceLabels"][0]: r["targetLabel"]
        for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    }

    def meta(label: str) -> str:
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    assert sources == {
        meta(manifests.LABEL_JOB): "job_name",
        meta(manifests.LABEL_ROLE): "role",
        meta(manifests.LABEL_INDEX): "index",
    }
    # The workers' metrics port is named as the PodMonitor expects.
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_notes_tell_the_user_what_next_and_how_to_upgrade_the_crd(helm):
    out = subprocess.run(
        [helm, "install", "rt", str(CHART), "--dry-run=client", "--namespace", "rt"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "rollout status deployment/rt-ringtrain" in notes
    assert "kubectl apply --server-side -f charts/ringtrain/crds/" in notes


def test_network_policy_value_reaches_the_operator_with_its_own_pod_labels(render):
    (dep,) = by_kind(render(), "Deployment")
    pod = dep["spec"]["template"]
    args = operator_main.parse_args(pod["spec"]["containers"][0]["args"][1:])
    settings = operator_main.network_settings(args, "rt")
    assert settings.metrics_namespace_labels == {"kubernetes.io/metadata.name": "monitoring"}
    # The policy admits the operator's pods to the chief's /status: its labels must match.
    assert settings.operator_pod_labels.items() <= pod["metadata"]["labels"].items()
    (dep,) = by_kind(
        render(
            "--set",
            "networkPolicy.enabled=false",
            "--set",
            "networkPolicy.metricsNamespaceLabels.team=obs",
        ),
        "Deployment",
    )
    assert (
        operator_main.parse_args(
            dep["spec"]["template"]["spec"]["containers"][0]["args"][1:]
        ).network_policy
        is False
    )
