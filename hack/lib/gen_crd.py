#!/usr/bin/env python3
"""Write the CRD's spec.trainer block from the option table (trainer/ringtrain/options.py).

    .venv/bin/python hack/gen-crd            # rewrite both CRD files
    .venv/bin/python hack/gen-crd --check    # exit 1 with a unified diff when one is stale

Why generated: spec.trainer is one field per trainer option, and the option table is where an
option is defined; the rest of the CRD (replicas, run policy, status, printer columns) is written
by hand. Only the lines of the ``trainer:`` block are replaced, so the hand-written part keeps its
comments and anchors. The operator's package copy and the chart's ``crds/`` copy are the same
file; tests/operator/test_options.py fails while either is behind.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRDS = (
    ROOT / "operator" / "ringtrain_operator" / "crd" / "trainingjobs.yaml",
    ROOT / "charts" / "ringtrain" / "crds" / "trainingjobs.yaml",
)
#: The block's first line in the hand-written CRD; it ends at the next line indented as little.
ANCHOR = "                trainer:\n"

sys.path.insert(0, str(ROOT / "trainer"))
try:
    from ringtrain import optiongen
except ImportError:  # run with a bare python3: use the project's virtualenv
    venv_python = ROOT / ".venv" / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != venv_python.parent.parent.resolve():
        os.execv(venv_python, [str(venv_python), __file__, *sys.argv[1:]])
    raise


def _scalar(value) -> str:
    """YAML flow scalars: JSON spelling, integral floats as integers, plain simple strings."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if (
        isinstance(value, str)
        and value[:1] in ("/", *"abcdefghijklmnopqrstuvwxyz")
        and value.replace("-", "").replace("/", "").isalnum()
        and value not in ("true", "false", "null", "yes", "no", "on", "off")
    ):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _lines(name: str, node: dict, indent: int) -> list[str]:
    pad = " " * indent
    if "properties" not in node:  # a field: one flow mapping on one line
        return [f"{pad}{name}: {{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in node.items()) + "}"]
    out = [f"{pad}{name}:"]
    out += [f"{pad}  {k}: {_scalar(v)}" for k, v in node.items() if k != "properties"]
    out.append(f"{pad}  properties:")
    for child, sub in node["properties"].items():
        out += _lines(child, sub, indent + 4)
    return out


def block() -> str:
    indent = len(ANCHOR) - len(ANCHOR.lstrip())
    return "\n".join(_lines("trainer", optiongen.trainer_schema(), indent)) + "\n"


def render(text: str) -> str:
    """``text`` (a CRD file) with its trainer block replaced by the generated one."""
    start = text.index(ANCHOR)
    indent = len(ANCHOR) - len(ANCHOR.lstrip())
    lines = text[start:].splitlines(keepends=True)
    end = next(
        i
        for i, line in enumerate(lines[1:], 1)
        if line.strip() and len(line) - len(line.lstrip()) <= indent
    )
    return text[:start] + block() + "".join(lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when stale")
    args = parser.parse_args(argv)
    stale = 0
    for path in CRDS:
        have = path.read_text()
        want = render(CRDS[0].read_text())  # the package copy is the source of the rest
        if have == want:
            continue
        if args.check:
            sys.stdout.writelines(
                difflib.unified_diff(
                    have.splitlines(keepends=True),
                    want.splitlines(keepends=True),
                    fromfile=f"{path} (committed)",
                    tofile=f"{path} (generated)",
                )
            )
            print(f"{path} is stale: run .venv/bin/python hack/gen-crd", file=sys.stderr)
            stale = 1
        else:
            path.write_text(want)
    return stale


if __name__ == "__main__":
    sys.exit(main())
