"""Start real ring members (``ring_worker.py``) as separate processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from support.ports import loopback_addresses
from support.procs import kill, new_token, without_cluster

WORKER = Path(__file__).with_name("ring_worker.py")


@dataclass
class Ring:
    """N processes running one scenario; ``addresses`` in rank order; ``token`` the secret."""

    procs: list[subprocess.Popen]
    addresses: list[str]
    token: bytes
    outputs: dict[int, list[dict]] = field(default_factory=dict)
    tls_dir: Path | None = None  # the job's TLS material, when the ring runs mutual TLS

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

    def go(self, rank: int) -> None:
        """Let ``rank`` go on where its scenario holds it (``pause``: rank 1 before step 2)."""
        self.procs[rank].stdin.write("go\n")
        self.procs[rank].stdin.flush()

    def start_rank(self, rank: int) -> None:
        env = dict(without_cluster(), RINGTRAIN_TOKEN=self.token.decode())
        if self.tls_dir is not None:
            env["RINGTRAIN_TLS_DIR"] = str(self.tls_dir)
        self.procs[rank] = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                *self.argv,
                "--rank",
                str(rank),
                *self.extra.get(rank, []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def kill(self) -> None:
        """Kill whatever still runs; reap all (closing the pipes of those that ended)."""
        kill(self.procs)


def write_tls(directory: Path, name: str = "ring") -> Path:
    """A job's TLS material (``ringtrain.pki``) as files, the way the Pod mounts them."""
    from ringtrain import pki

    directory.mkdir(parents=True, exist_ok=True)
    for file, content in pki.create(name, "default", name).files().items():
        (directory / file).write_bytes(content)
    return directory


def register(ring: Ring, rank: int, as_rank: int) -> dict:
    """``rank``'s answer to a Register call made as ``as_rank`` with the job's token (and, on a
    TLS ring, the job's certificate): what a ring member learns at the rendezvous, the
    side channel's port and, for its left neighbour, its key."""
    from ringtrain_trainer.ring import channels, control, tls

    material = tls.load(ring.tls_dir) if ring.tls_dir is not None else None
    ch = channels.channel(ring.addresses[rank], material)
    try:
        return json.loads(
            ch.unary_unary(f"/{control.SERVICE}/Register")(
                b"",
                metadata=control.call_metadata(ring.token, as_rank, len(ring.addresses)),
                timeout=10,
            )
        )
    finally:
        ch.close()


def start(
    world: int,
    scenario: str,
    transport: str = "grpc+tcp",
    *args: str,
    ranks: list[int] | None = None,
    extra: dict[int, list[str]] | None = None,
    tls_dir: Path | None = None,
    token: bytes | None = None,
) -> Ring:
    """Start ``ranks`` (default: all) of a ``world``-member ring; :meth:`Ring.start_rank`
    starts the others later. ``extra`` adds arguments for single ranks; with ``tls_dir`` every
    member loads the job's TLS material from it (mutual TLS); ``token`` (default: a new one)
    makes it another ring of the same job."""
    token = token or new_token().encode()
    addresses = loopback_addresses(world)
    ring = Ring([None] * world, addresses, token, tls_dir=tls_dir)
    ring.argv = [scenario, "--addresses", ",".join(addresses), "--transport", transport, *args]
    ring.extra = extra or {}
    for r in range(world) if ranks is None else ranks:
        ring.start_rank(r)
    return ring
