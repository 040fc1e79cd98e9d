"""Real ring members as processes on loopback, started the way ``ringtrain run`` starts them:
one TF_CONFIG per member, one shared token, nothing inherited that would place a child in
another ring. Every multi-worker test runs real processes (STYLE: the ring in layers).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from ringtrain import cluster

#: The ``ringtrain`` command of this checkout, with this interpreter; ``ringtrain worker``.
CLI = [sys.executable, "-m", "ringtrain.cli"]
WORKER = [*CLI, "worker"]
#: What places a process in a ring; a child started from the tests' environment drops it.
CLUSTER_VARS = ("TF_CONFIG", "RINGTRAIN_TOKEN", "RINGTRAIN_TOKEN_FILE", "RINGTRAIN_TLS_DIR")


def ringtrain(
    *args: str, cwd: str | os.PathLike | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess:
    """``ringtrain ARGS`` run to its end (``timeout_s``), stdout and stderr captured as text;
    the caller judges the exit code."""
    return subprocess.run(
        [*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def mpirun(n: int) -> list[str]:
    """The start of a command line that runs ``n`` ranks under Debian's Open MPI here (as root,
    on however few cores the machine has)."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)]


def new_token() -> str:
    """A fresh ring token, as the operator generates one per job."""
    return secrets.token_hex(16)


def without_cluster(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the variables that would place a child in a
    ring, so a child started from it runs alone unless it is given its own."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in CLUSTER_VARS}


def member_env(
    addresses: Sequence[str], rank: int, token: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of ring member ``rank``: ``base`` (default: this process's) without
    cluster variables, plus the shared token and, in a ring of more than one, its TF_CONFIG."""
    env = dict(without_cluster(base), RINGTRAIN_TOKEN=token)
    if len(addresses) > 1:
        env["TF_CONFIG"] = cluster.build({"worker": list(addresses)}, "worker", rank)
    return env


def start_member(
    command: Sequence[str],
    addresses: Sequence[str],
    rank: int,
    token: str,
    base: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Ring member ``rank`` of the ring of ``addresses`` running ``command``, stdout and stderr
    piped as text."""
    return subprocess.Popen(
        list(command),
        env=member_env(addresses, rank, token, base),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_members(
    commands: Sequence[Sequence[str]],
    addresses: Sequence[str],
    token: str | None = None,
    *,
    base: Mapping[str, str] | None = None,
    before: Callable[[int], object] | None = None,
) -> list[subprocess.Popen]:
    """One process per rank, ``commands[rank]`` on the ring of ``addresses``
    (:func:`start_member`). ``before(rank)`` runs just before rank ``rank`` starts (to act while
    the earlier ranks wait for it)."""
    token = token or new_token()
    procs: list[subprocess.Popen] = []
    try:
        for rank, command in enumerate(commands):
            if before is not None:
                before(rank)
            procs.append(start_member(command, addresses, rank, token, base))
    except BaseException:
        kill(procs)
        raise
    return procs


def finish(
    procs: Sequence[subprocess.Popen], timeout_s: float, what: str = "worker"
) -> list[tuple[str, str]]:
    """Wait for every process; (stdout, stderr) per rank. A non-zero exit fails the test with
    the tail of its stderr; whatever still runs then is killed, so no process outlives the
    test."""
    outs = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, f"{what} {rank} exited {p.returncode}: {err[-2000:]}"
            outs.append((out, err))
    finally:
        kill(procs)
    return outs


def stop(proc: subprocess.Popen, timeout_s: float = 20, sig: int = signal.SIGTERM) -> int:
    """Ask ``proc`` to stop (``sig``), give it ``timeout_s`` to do so, then kill it; its exit
    code. A process that already ended is left as it is."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def kill(procs: Sequence[subprocess.Popen | None]) -> None:
    """Kill whatever of ``procs`` still runs and reap it (pipes closed)."""
    for p in procs:
        if p is None:
            continue
        if p.poll() is None:
            p.kill()
        p.communicate()
