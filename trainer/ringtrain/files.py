"""Writing a file so that a reader sees the old content or the new, never half of either; reading
a small file that another process (or a tenant) may have planted, without trusting it.

Why one module: checkpoints, the chief's "training done" record, the checkpoint directory's
owner file and the ``.keras``/ONNX exports are all read by another process (a restarted worker,
the evaluator, a second job, the user) that may look at any moment, and a crash or a full disk
mid-write must not leave a truncated file under the real name. The recipe is the usual one:
write a temporary file beside the target, flush and fsync it, rename it over the target (atomic
on POSIX within one directory), then fsync the directory so the rename itself survives a crash.

The directory may be shared with someone hostile (a PVC, a hostPath; issues 20 and 35): the
temporary file's name is unpredictable and it is created ``O_EXCL | O_NOFOLLOW`` — a symbolic
link (or anything) planted under it is never written through —, and the rename replaces a link
at the target itself rather than following it. :func:`read_regular` reads a control file (an
owner file, a manifest, a done marker) only if it is a regular file reached without a symbolic
link, opened non-blocking (a FIFO cannot hang it) and only up to a cap: a 3 GB "owner file" is
refused by name, never read whole.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

#: How many unpredictable temporary names :func:`atomic_write` tries before it gives up (each
#: one taken means something planted or left there: 8 in a row is not chance).
TEMPORARY_TRIES = 8


class Refused(ValueError):
    """A file :func:`read_regular` will not read (a link, a FIFO, a device, over its cap, gone);
    the message names it and why."""


def _nonce() -> str:
    return secrets.token_hex(6)


def temporary_name(path: Path, nonce: str | None = None) -> Path:
    """A hidden temporary file beside ``path`` that :func:`atomic_write` renames into place:
    ``.<name>.tmp-<pid>-<random>`` (the pid says whose it was, the random part makes it
    unguessable)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{nonce or _nonce()}")


def _create_temporary(path: Path) -> tuple[int, Path]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(TEMPORARY_TRIES):
        tmp = temporary_name(path)
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:
            continue  # planted or left over: never written through, another name
    raise FileExistsError(
        errno.EEXIST, f"{TEMPORARY_TRIES} temporary names beside it were all taken", str(path)
    )


def atomic_write(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably. On failure (a full disk: ENOSPC) the
    temporary file is removed and the OSError propagates, so callers can name the file and
    ``errors.exit_code_for`` still sees the exhaustion."""
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


def read_regular(path: str | os.PathLike[str], cap: int, what: str = "file") -> bytes:
    """The bytes of ``path`` if it is a regular file (not a symbolic link, FIFO, device or
    directory) of at most ``cap`` bytes; else :class:`Refused` naming it (``what``: what the
    file should be, for the message). At most ``cap + 1`` bytes are ever read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused(f"{path}: {what} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused(f"{path}: a symbolic link; refused (regular files only)") from e
        raise Refused(f"{path}: cannot open ({e})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise Refused(f"{path}: {kind}; refused (regular files only)")
        if st.st_size > cap:
            raise Refused(
                f"{path}: {st.st_size} bytes, larger than the cap of {cap} bytes for a {what}; "
                "refused"
            )
        os.set_blocking(fd, True)
        data = f.read(cap + 1)
    if len(data) > cap:
        raise Refused(f"{path}: larger than the cap of {cap} bytes for a {what}; refused")
    return data
