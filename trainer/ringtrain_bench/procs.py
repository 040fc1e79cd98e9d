"""Starting local ring members as separate processes: ports, TF_CONFIG and token, JSON results.

The benchmarks start real processes on loopback the way ``ringtrain run`` does (one TF_CONFIG
per member, one shared token), so that what they measure is the deployed path and not an
in-process shortcut. Keeping that here, apart from the trainer, means nothing in
``ringtrain_trainer`` depends on how it is benchmarked. (The tests have their own runner,
tests/support/procs.py; the port rule both follow is ``ringtrain.ports``.)
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Mapping

from ringtrain import cluster, ports

#: The benchmarks' data path names that are another path with shared memory on: ``grpc+shm``
#: is ``grpc+tcp`` between processes of one host (``ring.shm``); a bench's ``grpc+tcp`` runs
#: with shared memory off, as between pods.
SHM_VIA = {"grpc+shm": "grpc+tcp"}


def free_ports(n: int) -> list[int]:
    """``n`` free loopback ring ports, each with its side-channel port free
    (``ringtrain.ports``)."""
    return ports.free_ring_ports(n)


def loopback_addresses(n: int) -> list[str]:
    """``n`` ring addresses on 127.0.0.1, in rank order."""
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


def new_token() -> str:
    """A fresh ring token, as the operator generates one per job."""
    return secrets.token_hex(16)


def member_envs(base: Mapping[str, str], addresses: list[str], token: str) -> list[dict]:
    """One environment per ring member: ``base`` plus its TF_CONFIG and the shared token."""
    return [
        dict(
            base, RINGTRAIN_TOKEN=token, TF_CONFIG=cluster.build({"worker": addresses}, "worker", r)
        )
        for r in range(len(addresses))
    ]


def without_cluster(env: Mapping[str, str] | None = None) -> dict:
    """``env`` (default: this process's) without the variables that would place a child in a
    ring, so a child started from it runs alone unless it is given its own."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in ("TF_CONFIG", "RINGTRAIN_TOKEN_FILE")}


def run_processes(
    what: str, cmds: list[list[str]], envs: list[dict], timeout_s: float
) -> list[dict]:
    """Run the commands side by side; the JSON lines of their stdout, in command order.

    Any non-zero exit fails the whole run (a half-measured ring is no figure); whatever
    still runs then is killed, so no process outlives the call."""
    procs = [
        subprocess.Popen(c, env=e, stdout=subprocess.PIPE, text=True)
        for c, e in zip(cmds, envs, strict=True)
    ]
    outs = []
    try:
        for p, cmd in zip(procs, cmds, strict=True):
            out, _ = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"{what}: {' '.join(cmd[:4])}… exited {p.returncode}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(line) for line in "".join(outs).splitlines() if line.strip()]
