"""docs/architecture.md lists every module, in the layer the import contracts put it."""

from __future__ import annotations

from pathlib import Path

import module_map

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_module_map_is_the_code_s():
    text = PAGE.read_text()
    assert module_map.with_map(text) == text, (
        "docs/architecture.md's module map is stale: run "
        ".venv/bin/python hack/lib/module_map.py docs/architecture.md"
    )


def test_every_module_is_in_a_layer():
    text = PAGE.read_text()
    for package in module_map.FOLDERS:
        for name in module_map.modules(package):
            assert f"- `{name}` — " in text, name
