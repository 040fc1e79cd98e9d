"""Issue 20, "no pod without bounds", on the real API server: every object ``ringtrain render``
prints for the examples — trainer pods with the requests and limits the operator derived from
the memory plan, the stock example's own, and the NetworkPolicy — is admitted by a server-side
dry run (validation and admission, nothing created) in a namespace of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ringtrain_operator import render

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "example", ["fashion-mnist-2workers.yaml", "keras-model.yaml", "tensorflow-stock.yaml"]
)
def test_rendered_objects_with_their_bounds_are_admitted(kubectl, namespace, example):
    docs = list(yaml.safe_load_all((ROOT / "examples" / example).read_text()))
    objects = render.render(docs, namespace)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert pods and all(
        {"requests", "limits"} <= set(c["resources"]) for p in pods for c in p["spec"]["containers"]
    )
    assert objects[-1]["kind"] == "NetworkPolicy"
    body = yaml.safe_dump_all(objects)
    out = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=body).stdout
    assert out.count("created (server dry run)") == len(objects), out
