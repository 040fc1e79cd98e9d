"""Hostile YAML given to the real ``ringtrain render`` and ``ringtrain run`` processes (issue 20):
an alias bomb, nesting 100,000 deep, a file past the size cap and one of a million tiny nodes
are refused with exit 2 and a message naming the file and what is wrong, in bounded memory
(``VmHWM`` of the process itself, against rendering a real example in the same way).

Before: the alias bomb expanded as soon as the spec check walked it (not done within the
test's limit), the deep nesting was a ``RecursionError`` traceback with exit 1, the 4 MiB
document rendered (exit 0), and the million nodes were not done within 30 s either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "keras-model.yaml"
#: what refusing may add to the peak of rendering a real example (imports dominate both)
EXTRA_MIB = 40

#: runs ``ringtrain ARGS`` in this process, then reports its exit code and peak RSS
PROBE = r"""
import json, sys
from ringtrain import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"code": code, "peak_mib": int(hwm.split()[1]) / 1024}), file=sys.stderr)
"""

HEAD = "apiVersion: ringtrain.io/v1alpha1\nkind: TrainingJob\nmetadata:\n  name: hostile\n"
JOB = HEAD + "spec:\n  replicaSpecs:\n    Worker:\n      replicas: 1\n  trainer:\n    steps: 2\n"


def alias_bomb() -> str:
    """The billion laughs: 9 anchors, each a list of 9 aliases of the one before (9⁹ leaves)."""
    lines = ['  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return JOB.replace(
        "  trainer:", "  x-bomb:\n" + "\n".join("  " + x for x in lines) + "\n  trainer:"
    )


def scalar_alias_bomb() -> str:
    """A few nodes, gigabytes written out: one 100 kB scalar aliased 5,000 times (issue 35:
    ``render`` spent minutes writing it)."""
    big = "  annotations:\n    a: &a " + "x" * 100_000 + "\n"
    refs = "".join(f"    k{i}: *a\n" for i in range(5000))
    return JOB.replace("  name: hostile\n", "  name: hostile\n" + big + refs)


CASES: dict[str, tuple[str | bytes, str]] = {
    "alias bomb": (alias_bomb(), "refused: more than 100000 nodes, aliases counted"),
    "scalar alias bomb": (scalar_alias_bomb(), "refused: more than 6 MiB of values"),
    "!!int abc": (JOB.replace("replicas: 1", "replicas: !!int abc"), "a value YAML cannot read"),
    "invalid date": (
        HEAD.replace("  name: hostile", "  name: hostile\n  creationTimestamp: 2020-13-45")
        + "spec: {}\n",
        "a value YAML cannot read: month must be in 1..12",
    ),
    "invalid UTF-8": (JOB.encode().replace(b"hostile", b"host\xffile"), "not UTF-8 text"),
    "nested 100,000 deep": (
        HEAD + "spec: " + "[" * 100_000 + "]" * 100_000 + "\n",
        "nested deeper",
    ),
    "4 MiB": (JOB + "# " + "x" * (4 << 20) + "\n", "larger than 3 MiB"),
    "a million nodes": (
        HEAD + "x: [" + "1," * 1_000_000 + "1]\n",
        "refused: more than 100000 nodes, aliases counted",
    ),
}


def probe(*args: str, timeout_s: float = 30) -> tuple[dict, str]:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    *lines, last = p.stderr.strip().splitlines()
    return json.loads(last), "\n".join(lines)


@pytest.fixture(scope="module")
def baseline_mib() -> float:
    report, err = probe("render", str(EXAMPLE))
    assert report["code"] == 0, err
    return report["peak_mib"]


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_yaml_is_refused_by_render_with_exit_2_in_bounded_memory(
    tmp_path, baseline_mib, case
):
    text, why = CASES[case]
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    report, err = probe("render", str(path))
    print(json.dumps({"case": case, "baseline_mib": baseline_mib, **report}))
    assert report["code"] == 2, err
    assert f"ringtrain render: {path}: " in err and why in err, err
    assert "Traceback" not in err, err
    assert report["peak_mib"] < baseline_mib + EXTRA_MIB, (report, baseline_mib)


@pytest.mark.parametrize(
    "case", ["alias bomb", "nested 100,000 deep", "!!int abc", "invalid UTF-8"]
)
def test_hostile_yaml_is_refused_by_run_before_anything_runs(tmp_path, case):
    text, why = CASES[case]
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    report, err = probe("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert report["code"] == 2, err
    assert str(path) in err and why in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
