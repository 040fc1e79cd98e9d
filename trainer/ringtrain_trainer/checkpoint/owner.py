"""One job per checkpoint directory: the chief claims it in an owner file before any step.

Two jobs given one directory (a shared PVC or hostPath, two ``ringtrain run`` of one file)
overwrote each other's checkpoints, and each resumed from the other's (issue 20). The chief
now writes ``.ringtrain-owner.json`` naming its job, host and pid; a chief of another job finds
it and is refused (``InvalidSpec``, exit 2) with the owner's name and what to do. The job is
known by a digest of its ring token (random per TrainingJob, kept across its restarts; the
token itself is never written), so a restart of the same job — in place, in a new pod, on
another node — takes the directory over. A chief without a token (a lone worker) is known by
nothing but its host and pid; a claim whose process is gone from this very host (a killed
``ringtrain run``) is stale and taken over. The claim is dropped when the chief ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path

from ringtrain import files
from ringtrain.errors import InvalidSpec

OWNER_FILE = ".ringtrain-owner.json"


def job_id(token: bytes | None) -> str | None:
    """A name for the job that reveals nothing of its token (None: no token, no job)."""
    if not token:
        return None
    return hashlib.sha256(b"ringtrain checkpoint owner\0" + token).hexdigest()[:16]


def _alive_here(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # elsewhere: cannot tell, so it counts as alive
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(owner: dict) -> str:
    return (
        f"job {owner.get('job') or '(no token)'}, host {owner.get('host')}, pid {owner.get('pid')}"
        f", since {owner.get('since')}"
    )


#: how long a chief without a token waits for a previous owner on its own host to exit: a
#: restarted MPI rank 0 (no ring token) can start while mpirun still reaps the rank it replaces
STALE_WAIT_S = 10.0


def _gone_soon(owner: dict, me: dict) -> bool:
    """Whether a token-less owner on this host exits within :data:`STALE_WAIT_S`."""
    if owner.get("host") != me["host"] or owner.get("job") or me["job"]:
        return False
    deadline = time.monotonic() + STALE_WAIT_S
    while time.monotonic() < deadline:
        if not _alive_here(owner):
            return True
        time.sleep(0.1)
    return False


def claim(directory: str | os.PathLike, token: bytes | None) -> Path:
    """Make this process the owner of ``directory`` or refuse, naming the owner."""
    path = Path(directory) / OWNER_FILE
    me = {
        "job": job_id(token),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        owner = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        owner = None  # unreadable or torn: nobody's
    if isinstance(owner, dict):
        same_job = me["job"] is not None and owner.get("job") == me["job"]
        same_process = owner.get("host") == me["host"] and owner.get("pid") == me["pid"]
        if not (same_job or same_process) and _alive_here(owner) and not _gone_soon(owner, me):
            raise InvalidSpec(
                f"--checkpoint-dir {directory}: in use by another job ({describe(owner)}); one "
                "job per checkpoint directory: give this job its own, or remove "
                f"{path} if that job is gone"
            )
    return files.atomic_write(path, json.dumps(me).encode())


def release(path: Path) -> None:
    """Drop the claim if it is still this process's."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
