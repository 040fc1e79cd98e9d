"""One job per checkpoint directory: the chief holds a lease on it in an owner file.

Two jobs given one directory (a shared PVC or hostPath, two ``ringtrain run`` of one file)
overwrote each other's checkpoints, and each resumed from the other's (issue 20). The chief
writes ``.ringtrain-owner.json`` naming its job, host and pid before any step; a chief of
another job finds it and is refused (``InvalidSpec``, exit 2) with the owner's name and what to
do. The job is known by a digest of its ring token (random per TrainingJob, kept across its
restarts; the token itself is never written), so a restart of the same job — in place, in a new
pod, on another node — takes the directory over at once.

The claim is a **lease** (issue 35): it carries a random token of its own and an expiry,
renewed every :data:`RENEW_S` by a thread while the chief lives and before every checkpoint it
writes (``CheckpointManager.save`` calls :func:`confirm`). A claim of another job holds until
its expiry (plus :data:`SKEW_S` for clocks of different hosts); a stale one, past it, is taken
over. Whether the owner's process still runs is asked only where the answer means something:
in the owner's own PID namespace on the owner's own boot (recorded as ``pidns``), where a gone
pid frees the directory at once (a killed ``ringtrain run``; a restarted token-less MPI rank 0
waits up to :data:`STALE_WAIT_S` for the rank it replaces). Before, a pid was checked on any
host of the same name: a second job in another PID namespace saw no such process, took over a
live directory and reported the first job's result as its own. A chief that finds its lease
taken (it stalled past the expiry) stops before it writes another checkpoint, naming the new
owner. Two claims at the very same moment: the last rename wins, the other finds out reading
back or at its first renewal, before any checkpoint.

The owner file is read as any control file is (``files.read_regular``: at most
:data:`MAX_OWNER_BYTES`, no symbolic link, no FIFO); one that is not a claim (too large, a link,
garbled, an absurd expiry) is named on stderr and taken over — the rename replaces it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from ringtrain import files
from ringtrain.errors import InvalidSpec

OWNER_FILE = ".ringtrain-owner.json"
#: an owner record is a few hundred bytes; anything larger is not one
MAX_OWNER_BYTES = 1 << 16
#: how long a claim holds without a renewal
LEASE_S = 60.0
#: how often the holder renews it (four chances before it lapses)
RENEW_S = LEASE_S / 4
#: how far two hosts' clocks may disagree: a lease is stale this long after its expiry
SKEW_S = 15.0
#: how long a chief without a token waits for a previous owner in its own PID namespace to exit:
#: a restarted MPI rank 0 (no ring token) can start while mpirun still reaps the rank it replaces
STALE_WAIT_S = 10.0


def job_id(token: bytes | None) -> str | None:
    """A name for the job that reveals nothing of its token (None: no token, no job)."""
    if not token:
        return None
    return hashlib.sha256(b"ringtrain checkpoint owner\0" + token).hexdigest()[:16]


def pid_namespace() -> str | None:
    """This process's PID namespace on this boot (None: not Linux, no /proc): two records with
    the same value name pids of one process table."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{st.st_dev}:{st.st_ino}"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def describe(owner: dict) -> str:
    until = owner.get("expires")
    lease = ""
    if isinstance(until, float) and 0 <= until < 1e11:  # a stamp for any believable time
        lease = f", lease until {_stamp(until)}"
    return (
        f"job {owner.get('job') or '(no token)'}, host {owner.get('host')}, pid {owner.get('pid')}"
        f", since {owner.get('since')}{lease}"
    )


def _note(msg: str) -> None:
    print(f"ringtrain worker: {msg}", file=sys.stderr, flush=True)


def _read(path: Path, quiet: bool = False) -> dict | None:
    """The owner record in ``path``; None if there is none or it is not one (named on stderr
    unless ``quiet``). An open that fails for want of a resource (EMFILE, ENOMEM) is no answer:
    its OSError propagates."""
    why = None
    try:
        owner = json.loads(files.read_regular(path, MAX_OWNER_BYTES, "owner file"))
    except files.Refused as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and cause.errno not in (errno.ELOOP, errno.ENOENT):
            raise cause from None
        owner, why = None, f"{e}; not a claim" if os.path.lexists(path) else None
    except (ValueError, RecursionError) as e:
        owner, why = None, f"{path}: not an owner record ({type(e).__name__})"
    if owner is not None and not isinstance(owner, dict):
        owner, why = None, f"{path}: not an owner record (a JSON {type(owner).__name__})"
    if why and not quiet:
        _note(f"{why}; taken over")
    return owner


def _expiry(owner: dict, path: Path, now: float) -> float | None:
    """When ``owner``'s claim lapses (a record written before leases: :data:`LEASE_S` after its
    file was written); None if it states no believable expiry."""
    exp = None
    if "lease" in owner:
        exp = owner.get("expires")
    else:
        with contextlib.suppress(OSError):
            exp = os.lstat(path).st_mtime + LEASE_S
    if isinstance(exp, bool) or not isinstance(exp, int | float) or not math.isfinite(exp):
        return None
    if exp > now + LEASE_S + SKEW_S:  # no holder renews that far ahead
        return None
    return float(exp)


def _pid_alive(owner: dict) -> bool | None:
    """Whether the owner's process runs (None: cannot tell from here — another PID namespace,
    another host, a record without one)."""
    ns = pid_namespace()
    if ns is None or owner.get("pidns") != ns:
        return None
    pid = owner.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holds(owner: dict, me: dict, path: Path) -> bool:
    """Whether another job's claim ``owner`` still holds against ``me``."""
    now = time.time()
    exp = _expiry(owner, path, now)
    if exp is None:
        _note(f"{path}: {describe(owner)}: no believable lease expiry; taken over")
        return False
    if now > exp + SKEW_S:
        return False  # stale: its holder stopped renewing
    alive = _pid_alive(owner)
    if alive is None:
        return True  # another namespace or host: the lease decides
    if not alive:
        return False
    if owner.get("job") or me["job"]:
        return True
    deadline = time.monotonic() + STALE_WAIT_S  # token-less: a restarted MPI rank 0
    while time.monotonic() < deadline:
        if not _pid_alive(owner):
            return False
        time.sleep(0.1)
    return True


class Lease:
    """This process's claim on one checkpoint directory, renewed until :meth:`release`."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _lost(self, now: dict | None) -> InvalidSpec:
        who = f"another job ({describe(now)})" if now else "nobody (the owner file is gone)"
        return InvalidSpec(
            f"--checkpoint-dir {self.path.parent}: this job's claim was taken over by {who}; "
            "it stalled past its lease, or another job was given this directory: stopping "
            "before another checkpoint is written"
        )

    def renew(self) -> None:
        """Extend the lease by :data:`LEASE_S`; :class:`InvalidSpec` if it is no longer ours."""
        with self._lock:
            now = _read(self.path, quiet=True)
            if now is None or now.get("lease") != self.record["lease"]:
                raise self._lost(now)
            self.record = {**self.record, "expires": time.time() + LEASE_S}
            files.atomic_write(self.path, json.dumps(self.record).encode())

    def _keep(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self.renew()
            except InvalidSpec:
                return  # the next checkpoint (confirm) says so and stops the job
            except OSError as e:  # a full disk: the next try, or the checkpoint, will tell
                _note(f"{self.path}: cannot renew the checkpoint directory's lease ({e})")

    def start(self) -> Lease:
        self._thread = threading.Thread(target=self._keep, name="checkpoint-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing; drop the claim if it is still this lease's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock, contextlib.suppress(OSError):  # on the way out: never an error
            now = _read(self.path, quiet=True)
            if now is not None and now.get("lease") == self.record["lease"]:
                self.path.unlink(missing_ok=True)
        _HELD.pop(_key(self.path.parent), None)


#: the leases this process holds, by checkpoint directory (``confirm`` renews one before a save)
_HELD: dict[str, Lease] = {}


def _key(directory: str | os.PathLike) -> str:
    return os.path.realpath(directory)


def claim(directory: str | os.PathLike, token: bytes | None) -> Lease:
    """Make this process the owner of ``directory`` or refuse, naming the owner."""
    path = Path(directory) / OWNER_FILE
    now = time.time()
    me = {
        "job": job_id(token),
        "lease": secrets.token_hex(16),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pidns": pid_namespace(),
        "since": _stamp(now),
        "expires": now + LEASE_S,
    }
    owner = _read(path)
    if owner is not None:
        same_job = me["job"] is not None and owner.get("job") == me["job"]
        mine = _HELD.get(_key(directory))
        # this very process: a lease it holds, or its own before it re-executed (a rejoin
        # keeps its pid: ``ringtrain_trainer.rejoin``)
        same_process = (mine is not None and owner.get("lease") == mine.record["lease"]) or (
            me["pidns"] is not None
            and (owner.get("pidns"), owner.get("pid")) == (me["pidns"], me["pid"])
        )
        if not (same_job or same_process) and _holds(owner, me, path):
            raise InvalidSpec(
                f"--checkpoint-dir {directory}: in use by another job ({describe(owner)}); one "
                "job per checkpoint directory: give this job its own, or remove "
                f"{path} if that job is gone"
            )
    if (old := _HELD.pop(_key(directory), None)) is not None:
        old._stop.set()
    files.atomic_write(path, json.dumps(me).encode())
    back = _read(path, quiet=True)  # two claims at one moment: the last rename won
    if back is None or back.get("lease") != me["lease"]:
        raise Lease(path, me)._lost(back)
    lease = _HELD[_key(directory)] = Lease(path, me)
    return lease.start()


def confirm(directory: str | os.PathLike) -> None:
    """Before a checkpoint is written to ``directory``: renew this process's lease on it, or
    :class:`InvalidSpec` naming who took it over (no lease held here: nothing to do)."""
    lease = _HELD.get(_key(directory))
    if lease is not None:
        lease.renew()


def release(lease: Lease) -> None:
    """Drop the claim if it is still this process's."""
    lease.release()
