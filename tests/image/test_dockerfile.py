"""What can be checked about the image without a container engine: every COPY source exists and
survives .dockerignore, the entrypoint and every command the chart and the operator's Pods run
exist in the installed package, the UID agrees everywhere, and the image installs the lock."""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from ringtrain import cli
from ringtrain_operator import manifests, spec
from ringtrain_operator.job import API_VERSION, KIND

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pattern_regex(pattern: str) -> str:
    """A .dockerignore pattern as a regex: ``*`` within a segment, ``**`` any depth."""
    regex = re.escape(pattern.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*")
    return regex.replace("/\0", "(/.*)?").replace("\0/", "(.*/)?").replace("\0", ".*")


def dockerignore_excludes(path: str) -> bool:
    """Docker's .dockerignore semantics: last matching pattern wins, ``!`` re-includes, ``**``."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = pattern_regex(pattern.lstrip("!"))
        if re.fullmatch(regex, path) or any(
            re.fullmatch(regex, str(p)) for p in Path(path).parents if str(p) != "."
        ):
            excluded = not negate
    return excluded


def copy_sources() -> list[str]:
    srcs = []
    for word, args in instructions():
        if word == "COPY" and "--from=" not in args:
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            srcs.extend(parts[:-1])
    return srcs


def test_every_copy_source_exists_and_is_in_the_build_context():
    srcs = copy_sources()
    assert {"requirements/runtime.txt", "pyproject.toml", "trainer", "operator"} <= set(srcs)
    for src in srcs:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: no such file in the repository"
        files = [path] if path.is_file() else list(path.rglob("*.py"))
        assert files, f"COPY {src}: nothing to copy"
        for f in files:
            rel = str(f.relative_to(ROOT))
            assert not dockerignore_excludes(rel), f"COPY {src}: {rel} is excluded by .dockerignore"


def test_dockerignore_keeps_the_venv_and_git_out_of_the_context():
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/chart/test_chart.py",
        "trainer/ringtrain/__pycache__/cli.cpython-311.pyc",
        "charts/ringtrain/Chart.yaml",
    ):
        assert dockerignore_excludes(path), path
    assert not dockerignore_excludes("trainer/ringtrain_trainer/ring/__init__.py")


def test_multi_stage_on_slim_bookworm_python_matching_pyproject():
    ins = instructions()
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    base = next(a for w, a in ins if w == "ARG" and a.startswith("BASE_IMAGE="))
    assert base == "BASE_IMAGE=python:3.11-slim-bookworm"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    assert ("COPY", "--from=build /opt/ringtrain /opt/ringtrain") in ins


def test_entrypoint_is_the_ringtrain_console_script():
    ins = {w: a for w, a in instructions() if w in ("ENTRYPOINT", "CMD")}
    assert ins["ENTRYPOINT"] == '["ringtrain"]'
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["ringtrain"].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    (ep,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "ringtrain"]
    assert ep.value == scripts["ringtrain"]


def _command_module(words: list[str]) -> str:
    for n in (2, 1):
        if tuple(words[:n]) in cli.COMMANDS:
            return cli.COMMANDS[tuple(words[:n])][0]
    raise AssertionError(
        f"`ringtrain {' '.join(words)}` is not a command of trainer/ringtrain/cli.py"
    )


def test_commands_the_chart_and_the_operator_run_exist_in_the_package():
    """`ringtrain operator` (chart) and `ringtrain worker` (every worker Pod) must import."""
    deployment = (ROOT / "charts" / "ringtrain" / "templates" / "deployment.yaml").read_text()
    assert re.search(r"args:\n\s+- operator\n", deployment)
    job = spec.load(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "img"},
            "spec": {"replicaSpecs": {"Worker": {"replicas": 1}}, "trainer": {}},
        }
    )
    (pod,) = [o for o in manifests.desired_objects(job) if o["kind"] == "Pod"]
    container = pod["spec"]["containers"][0]
    assert container["command"][0] == "ringtrain"
    for words in (["operator"], container["command"][1:]):
        name, _, func = _command_module(words).partition(":")
        module = importlib.import_module(name)
        assert callable(getattr(module, func or "main")), f"{name}.{func or 'main'}"
    # The image and its data set are what the CRD defaults to.
    assert container["image"] == "ringtrain:0.1.0"
    assert "/usr/share/datasets/fashion-mnist" in container["args"]
    dataset = next(a for w, a in instructions() if w == "ARG" and a.startswith("FASHION_MNIST"))
    assert "dataset-fashion-mnist=${FASHION_MNIST_VERSION}" in DOCKERFILE.read_text()
    assert dataset.split("=", 1)[1]  # pinned


def test_uid_is_the_same_in_image_chart_and_worker_pods():
    ins = instructions()
    user = next(a for w, a in ins if w == "USER")
    assert user == "10001:10001"
    assert "--uid 10001" in DOCKERFILE.read_text() and "--gid 10001" in DOCKERFILE.read_text()
    values = yaml.safe_load((ROOT / "charts" / "ringtrain" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["runAsGroup"] == 10001
    assert manifests.RUN_AS_USER == 10001


def test_ca_secret_is_optional_and_never_stored():
    text = DOCKERFILE.read_text()
    mounts = [m for w, a in instructions() if w == "RUN" for m in re.findall(r"--mount=(\S+)", a)]
    assert mounts == ["type=secret,id=ca,required=false"]
    # Only the one pip step that downloads sees the CA; nothing persists it in a layer.
    assert "ENV PIP_CERT" not in text and "update-ca-certificates" not in text
    # A `# syntax=` line would make BuildKit download a frontend image (offline builds fail).
    assert not re.search(r"^\s*#\s*syntax=", text, re.M)
    assert "--mount=type=cache" not in text and "--mount=type=bind" not in text


def test_image_installs_the_lock_s_runtime_part_with_hashes():
    """The image gets the versions and files the suite ran: requirements/runtime.txt (checked
    against the lock by tests/image/test_lock.py) plus mlxtend's block, hash-checked, wheels only,
    and the build itself compares the installed set with them."""
    runs = [a for w, a in instructions() if w == "RUN"]
    (install,) = [r for r in runs if "-r /tmp/runtime.txt" in r]
    for flag in (
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "-r /tmp/image-data.txt",
        "-r /tmp/image-mpi.txt",
    ):
        assert flag in install
    assert any("diff /tmp/locked.txt /tmp/installed.txt" in r for r in runs)
    assert "MLXTEND_VERSION" not in DOCKERFILE.read_text()


@pytest.mark.parametrize(
    "pattern,path,matches",
    [
        ("**", "a/b/c", True),
        ("trainer/**", "trainer/ring/x.py", True),
        ("trainer/**", "operator/x.py", False),
        ("**/*.pyc", "a/b/c.pyc", True),
        ("**/*.pyc", "c.pyc", True),
        ("*.md", "docs/x.md", False),
        ("README.md", "README.md", True),
    ],
)
def test_dockerignore_pattern_matcher_follows_docker_semantics(pattern, path, matches):
    """The matcher must itself be right, or the COPY test proves nothing."""
    assert bool(re.fullmatch(pattern_regex(pattern), path)) == matches
