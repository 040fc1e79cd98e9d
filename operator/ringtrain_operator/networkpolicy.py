"""The per-job NetworkPolicy: who may reach a job's ring and metrics ports.

A child of the TrainingJob like its Service and Secret (same owner reference, created once by
:func:`.reconcile.act`), built here as pure data from the :class:`~.spec.Job` and the operator's
settings. Ingress only, and only what the job needs:

- the ring port from pods of the *same* job (``ringtrain.io/job-name`` equal), nothing else: the
  HMAC handshake already refuses strangers, the policy keeps them from even connecting;
- the metrics port from namespaces matching ``metrics_namespace_labels`` (Prometheus) and from
  the operator's own pods, which read the chief's ``/status`` for progress.

A policy is enforced only by a CNI that implements NetworkPolicy (Calico, Cilium, kindnet ≥ 0.24,
...); the local cluster's bridge plugin ignores it, so ``tests/operator/test_networkpolicy.py``
evaluates the rendered policy against the pods' labels instead. The namespace label used by
default, ``kubernetes.io/metadata.name``, is set by the API server from Kubernetes 1.21 on; on
older clusters label the monitoring namespace by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from . import manifests
from .job import Job

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (a matchLabels selector as one flag value) → dict; empty text → {}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"{part!r} is not KEY=VALUE")
        out[key] = value
    return out


@dataclass(frozen=True)
class Settings:
    """What the chart (``networkPolicy.*``) tells the operator through its flags."""

    metrics_namespace_labels: Mapping[str, str] = field(
        default_factory=lambda: {NAMESPACE_NAME_LABEL: "monitoring"}
    )
    #: The operator's namespace (``$POD_NAMESPACE``) and pod labels; None: any namespace.
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "ringtrain"}
    )


def name(job: Job) -> str:
    return job.name


def network_policy(job: Job, settings: Settings) -> dict:
    """The job's NetworkPolicy (``networking.k8s.io/v1``), selecting exactly its pods."""
    same_job = {"podSelector": {"matchLabels": manifests.labels(job)}}
    # the ring: its gRPC port and, for the built-in trainer, the grpc+tcp side channel beside it
    ring = [manifests.RING_PORT, *([manifests.RING_DATA_PORT] if job.trainer else [])]
    rules = [{"from": [same_job], "ports": [{"protocol": "TCP", "port": p} for p in ring]}]
    if job.trainer:
        operator: dict = {"podSelector": {"matchLabels": dict(settings.operator_pod_labels)}}
        operator["namespaceSelector"] = (
            {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}}
            if settings.operator_namespace
            else {}
        )
        rules.append(
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": dict(settings.metrics_namespace_labels)}},
                    operator,
                ],
                "ports": [{"protocol": "TCP", "port": manifests.METRICS_PORT}],
            }
        )
    meta: dict = {"name": name(job), "namespace": job.namespace, "labels": manifests.labels(job)}
    if refs := manifests.owner_references(job):
        meta["ownerReferences"] = refs
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": manifests.labels(job)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
