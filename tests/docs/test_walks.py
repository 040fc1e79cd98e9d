"""docs/architecture.md's first-reconcile walk is the code's: hack/walk-count recounts it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def test_the_reconcile_walk_and_its_count_in_the_docs(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "walk-count"), "reconcile", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    files, stays, returns = map(
        int,
        re.search(
            r"MainThread +review +files +(\d+) +stays +(\d+) +returns +(\d+)", run.stdout
        ).groups(),
    )
    walk = (tmp_path / "MainThread-review.txt").read_text()
    assert files >= 5 and stays > files and returns == stays - files
    assert " lifecycle.py " in walk and " kube.py " in walk
    section = PAGE.read_text().split("## One first reconcile")[1].split("\n## ")[0]
    stated = re.search(r"review level: (\d+) files, (\d+) stays, (\d+) returns", section)
    assert stated, "docs/architecture.md: the reconcile walk's review-level count is missing"
    assert stated.groups() == (str(files), str(stays), str(returns)), (
        f"docs/architecture.md's reconcile walk is stale: the code gives {files} files, {stays} "
        f"stays, {returns} returns at the review level (recount: hack/walk-count reconcile)"
    )
