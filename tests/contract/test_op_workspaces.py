"""Every engine op declares its workspace as a type (decision 0102): the buffers the Program
allocates for it (``buffers``), its state (``state_specs``) and what ``bind`` adds are the
fields of a ``TypedDict`` named for the op, and every method's ``ws`` is annotated with it, so
mypy (``make lint``) refuses a misspelt or undeclared buffer. The op families listed in
:data:`UNTYPED` index their buffers by names computed at run time, which a ``TypedDict`` cannot
check; their ``ws`` is ``dict[str, Any]``, each with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "trainer/ringtrain_trainer/engine/ops"

UNTYPED = {
    "attention.py": "per-projection buffers named by the projection (``dp_{name}``)",
    "batchnorm.py": "the two moving statistics updated by name in one loop",
    "bidirectional.py": "the two directions' sub-workspaces, chosen by direction",
    "broadcast.py": "one input gradient per input (``dx{k}``)",
    "convtranspose.py": "sub-pixel phases' buffers named by phase",
    "depthwise.py": "buffers zeroed by name in a loop",
    "dot.py": "one input gradient per input (``dx{k}``)",
    "frozen.py": "the frozen weights, state named by their parameter",
    "fused.py": "ConvPool's fallback buffers allocated by name at bind",
    "groupconv.py": "one sub-workspace per group (``g{i}.``)",
    "merge.py": "one input gradient per input (``dx{k}``)",
    "recurrent.py": "the recurrent family's gate blocks read by computed key",
    "recurrent_fast.py": "the recurrent family's gate blocks read by computed key",
    "recurrent_gru.py": "the recurrent family's gate blocks read by computed key",
    "recurrent_loop.py": "the recurrent family's gate blocks read by computed key",
    "recurrent_lstm.py": "the recurrent family's gate blocks read by computed key",
    "shared.py": "a tied layer's accumulators named by parameter (``shared_{name}``)",
}


def _modules() -> list[Path]:
    return sorted(p for p in OPS.glob("*.py") if p.name != "__init__.py")


def _typeddicts(tree: ast.Module) -> dict[str, set[str]]:
    out = {}
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == "TypedDict" for b in c.bases
        ):
            out[c.name] = {
                s.target.id
                for s in c.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return out


def _literal_buffer_keys(fn: ast.FunctionDef) -> set[str]:
    """The names a ``buffers``/``state_specs`` method declares as literals."""
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Dict):
            keys |= {
                k.value
                for k in node.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            }
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            keys.add(node.slice.value)
        elif fn.name == "state_specs" and isinstance(node, ast.Tuple) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                keys.add(first.value)
    return keys


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_every_op_method_names_its_workspace_type(path: Path) -> None:
    tree = ast.parse(path.read_text())
    typed = _typeddicts(tree)
    imported = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if (a.asname or a.name).endswith("Ws")
    }
    for cls in (c for c in tree.body if isinstance(c, ast.ClassDef) and c.name not in typed):
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef)):
            for arg in (a for a in fn.args.args if a.arg == "ws"):
                where = f"{path.name}: {cls.name}.{fn.name}"
                assert arg.annotation is not None, f"{where}: ws is not annotated"
                ann = ast.unparse(arg.annotation)
                if ann in ("dict[str, Any]", "Any"):
                    assert path.name in UNTYPED or cls.name == "Activation", (
                        f"{where}: ws is untyped ({ann}) but {path.name} is not in UNTYPED"
                    )
                    continue
                assert ann in typed or ann in imported, (
                    f"{where}: ws is {ann}, not a workspace type"
                )
                if ann in typed and fn.name in ("buffers", "state_specs"):
                    continue
            if fn.name in ("buffers", "state_specs"):
                owners = {
                    ast.unparse(a.annotation)
                    for f in cls.body
                    if isinstance(f, ast.FunctionDef)
                    for a in f.args.args
                    if a.arg == "ws" and a.annotation is not None
                }
                for name in owners & set(typed):
                    missing = _literal_buffer_keys(fn) - typed[name]
                    assert not missing, (
                        f"{path.name}: {cls.name}.{fn.name} declares {sorted(missing)} that "
                        f"{name} does not list"
                    )


def test_the_untyped_list_holds_only_modules_that_need_it() -> None:
    for name in UNTYPED:
        src = (OPS / name).read_text()
        assert "ws: dict[str, Any]" in src, f"{name} is typed now: drop it from UNTYPED"
    typed = sum(len(_typeddicts(ast.parse(p.read_text()))) for p in _modules())
    assert typed >= 33  # the workspace types at the time of decision 0102
