"""Paths, value sets and helpers shared by the chart tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ringtrain"

#: Values that switch every optional part on and take the namespaced RBAC branch.
ALL_ON = [
    "--set",
    "metrics.serviceMonitor.enabled=true",
    "--set",
    "metrics.podMonitor.enabled=true",
    "--set",
    "metrics.prometheusRule.enabled=true",
    "--set",
    "grafana.dashboards.enabled=true",
    "--set",
    "rbac.clusterScoped=false",
    "--set",
    "rbac.watchNamespaces={team-a,team-b}",
    "--set",
    "image.repository=registry.example.com/ml/ringtrain",
    "--set",
    "image.tag=0.1.0-rc1",
    "--set",
    "image.pullPolicy=Never",
]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]
