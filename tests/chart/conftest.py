"""Fixtures for the chart tests: a static helm binary (hack/tools) and a render helper."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from chart_helpers import CHART, ROOT


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the static helm v4 binary, fetched once into the tools cache by hack/tools."""
    out = subprocess.run(
        [str(ROOT / "hack" / "tools"), "helm"], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def render(helm):
    """render(*args) → the rendered manifests as a list of dicts (helm template, namespace rt)."""

    def _render(*args: str) -> list[dict]:
        out = subprocess.run(
            [helm, "template", "rt", str(CHART), "--namespace", "rt", *args],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]

    return _render
