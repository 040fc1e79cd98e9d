"""Smoke tests of the local cluster itself (hack/local-cluster): what the operator and the trainer
rely on — a Ready node, pods from the project image, kind-like DNS for a headless Service's pods,
and in-cluster API access with a ServiceAccount token."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def pod(name: str, image: str, command: list[str], **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "smoke"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
            ],
            **spec,
        },
    }


def last_json_line(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line in the pod's output:\n{text}"
    return json.loads(lines[-1])


def test_node_is_ready_and_schedulable(kubectl):
    nodes = kubectl.json("get", "nodes")["items"]
    assert len(nodes) == 1
    node = nodes[0]
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert not [t for t in node["spec"].get("taints", []) if t["effect"] == "NoSchedule"]
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert not addresses["InternalIP"].startswith("127.")


def test_pod_from_project_image_runs_and_logs(kubectl, namespace, project_image, wait_pod):
    kubectl.apply(pod("version", project_image, ["ringtrain", "--version"]), namespace)
    wait_pod(namespace, "version", phases=("Succeeded",), timeout_s=120)
    out = kubectl("logs", "version", "-n", namespace).stdout
    assert project_image.split(":")[-1] in out


def test_the_tests_in_process_reads_answer_what_kubectl_answers(
    kubectl, namespace, project_image, wait_pod
):
    """The polls read the API server in-process (tests/e2e/api_reads.py, ≈1 ms of CPU instead
    of a kubectl process's ≈0.12 s): they must see exactly what ``kubectl -o json`` shows."""
    kubectl.apply(pod("reads", project_image, ["ringtrain", "--version"]), namespace)
    wait_pod(namespace, "reads", phases=("Succeeded",), timeout_s=120)
    for args in (
        ("get", "pod", "reads", "-n", namespace),
        ("get", "pods", "-n", namespace, "-l", "app=smoke"),
        ("get", "sa", "default", "-n", namespace),
        ("get", "service", "kubernetes", "-n", "default"),
    ):
        assert kubectl.reads.plan(args) is not None, args
        assert kubectl.json(*args) == json.loads(kubectl(*args, "-o", "json").stdout), args
    assert (
        kubectl.log("reads", namespace, "main") == kubectl("logs", "reads", "-n", namespace).stdout
    )
    assert project_image.split(":")[-1] in kubectl.log("reads", namespace, "main")
    assert kubectl.json("get", "pod", "absent", "-n", namespace, missing_ok=True) is None
    assert kubectl.log("absent", namespace, "main") == ""


def test_headless_service_pod_names_resolve_and_connect(
    kubectl, namespace, project_image, wait_pod
):
    # The operator's layout: pods with hostname + subdomain under a headless Service that
    # publishes not-ready addresses, peers addressed as <pod>.<svc>.<ns>.svc[.cluster.local].
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "peers"},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "smoke"},
            "ports": [{"name": "http", "port": 8000}],
        },
    }
    server = pod(
        "server",
        project_image,
        ["python3", "-m", "http.server", "8000"],
        hostname="server",
        subdomain="peers",
    )
    probe_src = f"""
import json, socket, time, urllib.request
names = ["server.peers.{namespace}.svc.cluster.local", "server.peers.{namespace}.svc"]
deadline = time.monotonic() + 60
result = {{}}
for name in names:
    while True:
        try:
            result[name] = socket.gethostbyname(name)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                result[name] = "error: %s" % exc
                break
            time.sleep(0.2)
while True:
    try:
        with urllib.request.urlopen("http://%s:8000/" % names[1], timeout=5) as r:
            result["http"] = r.status
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            result["http"] = "error: %s" % exc
            break
        time.sleep(0.2)
print(json.dumps(result))
"""
    probe = pod(
        "probe", project_image, ["python3", "-c", probe_src], hostname="probe", subdomain="peers"
    )
    kubectl.apply([service, server, probe], namespace)
    server_ip = wait_pod(namespace, "server", phases=("Running",))["status"]["podIP"]
    wait_pod(namespace, "probe", phases=("Succeeded",), timeout_s=120)
    result = last_json_line(kubectl("logs", "probe", "-n", namespace).stdout)
    assert result == {
        f"server.peers.{namespace}.svc.cluster.local": server_ip,
        f"server.peers.{namespace}.svc": server_ip,
        "http": 200,
    }


def test_in_cluster_api_access_with_service_account_token(
    kubectl, namespace, project_image, wait_pod
):
    # What an in-cluster operator does: https://kubernetes.default.svc with the mounted CA and
    # token, TLS verified, through the `kubernetes` Service (kube-proxy) and cluster DNS.
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader-pod-reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    ]
    src = f"""
import json, os, ssl, urllib.error, urllib.request
ctx = ssl.create_default_context(cafile="{SA_DIR}/ca.crt")
token = open("{SA_DIR}/token").read()
def get(path):
    req = urllib.request.Request("https://kubernetes.default.svc" + path,
                                 headers={{"Authorization": "Bearer " + token}})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None
status, pods = get("/api/v1/namespaces/{namespace}/pods")
denied, _ = get("/api/v1/namespaces/kube-system/secrets")
print(json.dumps({{"status": status, "pods": [p["metadata"]["name"] for p in pods["items"]],
                  "other_namespace": denied,
                  "env_host": os.environ.get("KUBERNETES_SERVICE_HOST")}}))
"""
    client = pod("client", project_image, ["python3", "-c", src], serviceAccountName="reader")
    kubectl.apply([*rbac, client], namespace)
    wait_pod(namespace, "client", phases=("Succeeded",), timeout_s=120)
    result = last_json_line(kubectl("logs", "client", "-n", namespace).stdout)
    service_ip = kubectl.json("get", "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    assert result == {
        "status": 200,
        "pods": ["client"],
        "other_namespace": 403,
        "env_host": service_ip,
    }


def test_cluster_ip_service_reaches_its_own_pod_hairpin(
    kubectl, namespace, project_image, wait_pod
):
    # kube-proxy (iptables) plus the bridge's hairpin mode: a pod reaches itself through the
    # ClusterIP of a Service that selects it.
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "smoke"}, "ports": [{"port": 80, "targetPort": 8000}]},
    }
    src = """
import http.server, json, threading, time, urllib.request
srv = http.server.ThreadingHTTPServer(("0.0.0.0", 8000), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=srv.serve_forever, daemon=True).start()
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen("http://web/", timeout=3) as r:
            print(json.dumps({"status": r.status}))
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            print(json.dumps({"status": "error: %s" % exc}))
            break
        time.sleep(0.2)
"""
    kubectl.apply([service, pod("self", project_image, ["python3", "-c", src])], namespace)
    wait_pod(namespace, "self", phases=("Succeeded",), timeout_s=120)
    assert last_json_line(kubectl("logs", "self", "-n", namespace).stdout) == {"status": 200}
