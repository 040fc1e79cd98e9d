"""Start real ring members (``ring_worker.py``) as separate processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ringtrain_bench.procs import loopback_addresses, new_token

WORKER = Path(__file__).with_name("ring_worker.py")


@dataclass
class Ring:
    """N processes running one scenario; ``addresses`` in rank order; ``token`` the secret."""

    procs: list[subprocess.Popen]
    addresses: list[str]
    token: bytes
    outputs: dict[int, list[dict]] = field(default_factory=dict)

    def event(self, rank: int) -> dict:
        """The next JSON line of ``rank`` (blocks; the test's timeout bounds it)."""
        line = self.procs[rank].stdout.readline()
        if not line:
            raise AssertionError(f"rank {rank} exited ({self.procs[rank].wait()}) without output")
        return json.loads(line)

    def finish(self, timeout_s: float = 30) -> list[tuple[int, list[dict]]]:
        """Wait for every process; (exit code, remaining JSON events) per rank."""
        results = []
        for p in self.procs:
            out, _ = p.communicate(timeout=timeout_s)
            results.append((p.returncode, [json.loads(x) for x in out.splitlines() if x]))
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def start(world: int, scenario: str, transport: str = "tcp", *args: str) -> Ring:
    token = new_token().encode()
    addresses = loopback_addresses(world)
    env = dict(os.environ, RINGTRAIN_TOKEN=token.decode())
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, "--rank", str(r),
                               "--addresses", ",".join(addresses), "--transport", transport,
                               *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    return Ring(procs, addresses, token)
