"""The job's Secret: token plus per-job TLS material, created once, mounted owner-read-only, and
never copied into a Pod's env, args or annotations."""

from __future__ import annotations

import base64
import json

from cryptography import x509
from fake_kube import FakeKube
from operator_jobs import job, job_obj
from test_reconcile import T0, no_fetch

from ringtrain import pki
from ringtrain_operator import manifests
from ringtrain_operator.reconcile import reconcile


def _data(sec: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in sec["data"].items()}


def test_the_secret_holds_the_token_and_a_job_certificate_for_every_replica_name():
    j = job(workers=2, chief=1)
    data = _data(manifests.secret(j, "s3cret"))
    assert sorted(data) == ["ca.crt", "tls.crt", "tls.key", "token"]
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    leaf = x509.load_pem_x509_certificate(data["tls.crt"])
    leaf.verify_directly_issued_by(ca)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*.mnist.team-a.svc" in sans.get_values_for_type(x509.DNSName)
    assert (
        pki.identity(data["tls.crt"])
        == pki.identity_uri("mnist", "team-a", "uid-1")
        == ("spiffe://ringtrain.io/ns/team-a/trainingjob/mnist/uid-1")
    )
    # every replica's TF_CONFIG host is covered by a SAN wildcard of exactly one label
    for role, i in [("chief", 0), ("worker", 1)]:
        host = manifests.dns_endpoint(j, role, i).rsplit(":", 1)[0]
        assert host.split(".", 1)[1] == "mnist.team-a.svc"


def test_the_secret_is_mounted_owner_read_only_and_no_key_material_reaches_env_or_args():
    j = job(workers=2)
    sec = manifests.secret(j, "s3cret")
    blobs = list(sec["data"].values())
    blobs += [base64.b64decode(v).decode() for v in sec["data"].values()]
    for p in manifests.pods(j):
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["ring-token"]["secret"] == {
            "secretName": "mnist-ring-token",
            "defaultMode": 0o400,
        }
        (c,) = p["spec"]["containers"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "ring-token")
        assert mount == {
            "name": "ring-token",
            "mountPath": "/var/run/ringtrain/ring-token",
            "readOnly": True,
        }
        env = {e["name"]: e for e in c["env"]}
        assert env["RINGTRAIN_TLS_DIR"]["value"] == mount["mountPath"]
        assert all("valueFrom" not in e for e in env.values())  # nothing from the Secret
        text = json.dumps(p)
        assert not any(b in text for b in blobs) and "PRIVATE KEY" not in text


def test_a_second_reconcile_never_regenerates_the_secret():
    kube = FakeKube(job_obj(workers=2))
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    first = kube.objects[("Secret", "mnist-ring-token")]
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)  # nothing to create
    del kube.objects[("Pod", "mnist-worker-0")]
    kube.job["status"] = {}  # a restarted operator recreating a lost pod
    reconcile(kube, "team-a", "mnist", now=T0, fetch=no_fetch)
    assert ("Pod", "mnist-worker-0") in kube.objects
    assert kube.objects[("Secret", "mnist-ring-token")] == first
    assert sorted(_data(first)) == ["ca.crt", "tls.crt", "tls.key", "token"]


def test_the_kubelets_grpc_probe_gets_a_plaintext_health_port_the_ring_port_stays_mtls(monkeypatch):
    from operator_jobs import job_obj as obj

    from ringtrain_operator import spec

    monkeypatch.setenv(manifests.PROBE_ENV, "grpc")
    j = spec.load(obj(workers=2, trainer={}))
    (c,) = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"]
    assert c["args"][-2:] == ["--ring-health-port", "2224"]
    assert {"name": "health", "containerPort": 2224, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["grpc"] == c["livenessProbe"]["grpc"] == {"port": 2224}
    monkeypatch.setenv(manifests.PROBE_ENV, "exec")
    (c,) = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"]
    assert "--ring-health-port" not in c["args"]
