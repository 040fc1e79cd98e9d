"""hack/tools on a machine that has never fetched anything: the chart tests' first call.

Stop 31's tree fetched helm and kubectl, then looked for checkov in the same archive and exited
1: every later call found helm cached, so only a fresh machine's first run failed (30 chart
tests errored in this stop's fresh-clone rehearsal)."""

from __future__ import annotations

import os
import subprocess

from chart_helpers import ROOT


def test_a_fresh_tools_cache_fetches_helm_and_kubectl(tmp_path):
    env = {**os.environ, "RINGTRAIN_TOOLS_DIR": str(tmp_path / "tools")}
    for tool, ask in (("helm", ["version"]), ("kubectl", ["version", "--client"])):
        out = subprocess.run(
            [str(ROOT / "hack" / "tools"), tool], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        binary = out.stdout.strip()
        assert binary == str(tmp_path / "tools" / tool)
        version = subprocess.run([binary, *ask], capture_output=True, text=True)
        assert version.returncode == 0 and "v" in version.stdout, version.stderr
