"""Least privilege, proven: every RBAC grant of the chart is used by a named function, and every
API call the operator makes is granted.

``GRANTS`` is the table a reviewer reads: (apiGroup, resource, verb) → the file, the function and
a string inside that function that makes the call (a client method, or the kopf decorator whose
watch needs it). The tests fail when the chart grants a verb missing from the table, when the
table names a function that no longer makes the call, and when ``kube.py`` (the only module that
talks to the API client) calls a method the table does not cover.
"""

from __future__ import annotations

import ast
import re

import pytest
from chart_helpers import ALL_ON, ROOT, by_kind

OPERATOR = ROOT / "operator" / "ringtrain_operator"

#: (apiGroup, resource, verb) → (file under operator/ringtrain_operator, function, evidence).
GRANTS = {
    ("ringtrain.io", "trainingjobs", "get"): (
        "kube.py",
        "Kube.get_job",
        "get_namespaced_custom_object",
    ),
    ("ringtrain.io", "trainingjobs", "list"): (
        "kube.py",
        "Kube.jobs_request",
        "list_namespaced_custom_object",
    ),
    ("ringtrain.io", "trainingjobs", "watch"): ("informer.py", "ListWatch._watch", "watch=True"),
    # an older operator's finalizer is removed with a merge patch of the object
    ("ringtrain.io", "trainingjobs", "patch"): (
        "kube.py",
        "Kube.patch_job",
        "patch_namespaced_custom_object(",
    ),
    ("ringtrain.io", "trainingjobs", "delete"): (
        "kube.py",
        "Kube.delete_job",
        "delete_namespaced_custom_object",
    ),
    ("ringtrain.io", "trainingjobs/status", "patch"): (
        "kube.py",
        "Kube.patch_status",
        "patch_namespaced_custom_object_status",
    ),
    # blockOwnerDeletion on a child needs update on the owner's finalizers (admission plugin
    # OwnerReferencesPermissionEnforcement).
    ("ringtrain.io", "trainingjobs/finalizers", "update"): (
        "manifests.py",
        "owner_references",
        '"blockOwnerDeletion": True',
    ),
    ("", "pods", "create"): ("kube.py", "Kube.create", "create_namespaced_pod"),
    ("", "pods", "delete"): ("kube.py", "Kube.delete_pod", "delete_namespaced_pod"),
    # an elastic job's size annotation on the pods that stay through a resize (issue 38)
    ("", "pods", "patch"): ("kube.py", "Kube.annotate_pod", "patch_namespaced_pod"),
    ("", "pods", "list"): ("kube.py", "Kube.pods_request", "list_namespaced_pod"),
    ("", "pods", "watch"): ("informer.py", "ListWatch._watch", "watch=True"),
    ("", "services", "create"): ("kube.py", "Kube.create", "create_namespaced_service"),
    ("", "secrets", "create"): ("kube.py", "Kube.create", "create_namespaced_secret"),
    # an MPI job's hostfile and sshd configuration (spec.mpi)
    ("", "configmaps", "create"): ("kube.py", "Kube.create", "create_namespaced_config_map"),
    ("networking.k8s.io", "networkpolicies", "create"): (
        "kube.py",
        "Kube.create",
        "create_namespaced_network_policy",
    ),
    ("", "events", "create"): ("kube.py", "Kube.create_event", "create_namespaced_event"),
    # what a create met (409): the job's own, or someone else's (issue 35)
    ("", "pods", "get"): ("kube.py", "Kube.read", "read_namespaced_pod"),
    ("", "services", "get"): ("kube.py", "Kube.read", "read_namespaced_service"),
    ("", "secrets", "get"): ("kube.py", "Kube.read", "read_namespaced_secret"),
    ("", "configmaps", "get"): ("kube.py", "Kube.read", "read_namespaced_config_map"),
    ("networking.k8s.io", "networkpolicies", "get"): (
        "kube.py",
        "Kube.read",
        "read_namespaced_network_policy",
    ),
}
#: Only with networkPolicy.enabled (the default).
NETWORK_POLICY_ONLY = {
    ("networking.k8s.io", "networkpolicies", "create"),
    ("networking.k8s.io", "networkpolicies", "get"),
}
#: The cluster-scoped install's read-only discovery role: kopf's scanning, which the namespaced
#: install switches off (main.operator_settings: ``scanning.disabled``).
DISCOVERY = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
}
#: kubernetes client method prefixes → RBAC verbs.
VERBS = {
    "create": "create",
    "delete": "delete",
    "list": "list",
    "patch": "patch",
    "get": "get",
    "read": "get",
    "replace": "update",
}


def grants(obj: dict) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in obj["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def function_source(file: str, qualname: str) -> str:
    """Source of a (possibly ``Class.method``) function, decorators included."""
    text = (OPERATOR / file).read_text()
    nodes = ast.parse(text).body
    *outer, name = qualname.split(".")
    for part in outer:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == part).body
    fn = next(
        n
        for n in nodes
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    return "\n".join(text.splitlines()[start - 1 : fn.end_lineno])


def client_calls() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every kubernetes client method kube.py calls."""
    text = (OPERATOR / "kube.py").read_text()
    out = set()
    for api, method in re.findall(r"self\.(core|custom|networking)\.(\w+)", text):
        verb, _, rest = method.partition("_")
        rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
        if api == "custom":
            resource = "trainingjobs/status" if rest.endswith("_status") else "trainingjobs"
            out.add(("ringtrain.io", resource, VERBS[verb]))
            continue
        group = {"core": "", "networking": "networking.k8s.io"}[api]
        resource = rest.replace("network_policy", "networkpolicie")
        resource = resource.replace("config_map", "configmap")
        out.add((group, resource + "s", VERBS[verb]))
    return out


@pytest.mark.parametrize("key", sorted(GRANTS), ids=lambda k: "/".join(filter(None, k)))
def test_every_grant_names_the_function_that_uses_it(key):
    file, fn, evidence = GRANTS[key]
    assert evidence in function_source(file, fn), f"{key}: {fn} in {file} no longer uses it"


def test_the_operator_calls_the_api_only_through_kube_py():
    """So scanning kube.py (and the kopf decorators) finds every call."""
    for path in OPERATOR.glob("*.py"):
        if path.name != "kube.py":
            assert not re.search(r"client\.\w+Api\(", path.read_text()), path.name


def test_every_client_call_is_granted():
    calls = client_calls()
    assert len(calls) >= 9  # the scan still finds the calls
    assert calls <= set(GRANTS), calls - set(GRANTS)


@pytest.mark.parametrize(
    "values,network",
    [([], True), (ALL_ON, True), (["--set", "networkPolicy.enabled=false"], False)],
    ids=["cluster-scoped", "namespaced", "no-networkpolicy"],
)
def test_the_chart_grants_exactly_the_table(render, values, network):
    objs = render(*values)
    cluster_scoped = "rbac.clusterScoped=false" not in values
    want = set(GRANTS) - (set() if network else NETWORK_POLICY_ONLY)
    roles = by_kind(objs, "ClusterRole" if cluster_scoped else "Role")
    main = [r for r in roles if not r["metadata"]["name"].endswith("-discovery")]
    assert main and all(grants(r) == want for r in main), [grants(r) ^ want for r in main]
    discovery = [grants(r) for r in roles if r["metadata"]["name"].endswith("-discovery")]
    assert discovery == ([DISCOVERY] if cluster_scoped else [])
    if not cluster_scoped:
        # Nothing cluster-wide: not even CRD discovery, which the operator does once through
        # the API's discovery endpoints (readable by every authenticated user).
        assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
