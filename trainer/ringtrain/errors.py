"""The trainer's exceptions and the one table that maps them to process exit codes.

The operator's ``ExitCode`` restart policy reads these codes: 1–127 are permanent (the user must
fix something), 128+ are retryable (the gang is recreated and resumes from the last checkpoint).
"""

from __future__ import annotations

import errno
import os

#: Training finished.
EXIT_OK = 0
#: Bad input the user must fix: spec, TF_CONFIG, flags, data set, model too large for the IPU.
EXIT_PERMANENT = 2
#: Training diverged: a non-finite loss, gradient or parameter; permanent (the same data and
#: settings diverge again), and apart from 2 so that the operator can say so (TrainingDiverged).
EXIT_DIVERGED = 3
#: A peer vanished or timed out; recreating the gang and resuming will likely succeed.
EXIT_RETRYABLE = 138
#: SIGTERM/SIGINT (128 + 15): stopped from outside, also retryable by the ExitCode policy.
EXIT_TERMINATED = 143


class RingtrainError(Exception):
    """Base of every error the trainer raises on purpose."""

    exit_code = EXIT_PERMANENT


class InvalidSpec(RingtrainError):
    """A configuration (flags, TF_CONFIG, job spec) that cannot work."""


class DataError(RingtrainError):
    """A data set file is missing or corrupt; the message names the file."""


class CheckpointError(RingtrainError):
    """A checkpoint is missing or corrupt; the message names it."""


class IPUCompileError(RingtrainError):
    """The program does not fit the emulated IPU; the message gives bytes needed and available."""


class Diverged(RingtrainError):
    """A non-finite loss, gradient or parameter; the message names the step, the worker and the
    first non-finite tensor."""

    exit_code = EXIT_DIVERGED


class RingError(RingtrainError):
    """A collective failed; the message starts with where: rank, step and peer.

    ``rank``, ``step`` and ``peer`` are the three things an operator needs to find the broken
    link, so they are kept as attributes and written in front of the message here, in one
    format for every site: ``rank 1 step 7 peer 10.0.0.2:2222: what happened`` (the parts that
    are not known are left out).
    """

    exit_code = EXIT_RETRYABLE

    def __init__(
        self, msg: str, *, rank: int | None = None, step: int | None = None, peer: str | None = None
    ) -> None:
        self.rank, self.step, self.peer, self.reason = rank, step, peer, msg
        where = " ".join(
            f"{name} {value}"
            for name, value in (("rank", rank), ("step", step), ("peer", peer))
            if value is not None
        )
        super().__init__(f"{where}: {msg}" if where else msg)


class PeerTimeout(RingError):
    """A peer did not answer within the deadline (at start-up or mid-step)."""


class Unauthenticated(RingError):
    """A peer presented no token or the wrong one."""

    exit_code = EXIT_PERMANENT


#: errnos that say the machine ran out of something (descriptors, disk, quota, memory), not that
#: the user erred: retryable wherever they surface, wrapped or not. 1,500 idle connections to a
#: worker's ring port made the chief's next checkpoint write fail with EMFILE, exit 1, which the
#: ExitCode policy took as permanent (issue 20).
RESOURCE_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.ENOBUFS}
)


def exhausted(exc: BaseException) -> OSError | None:
    """The OSError of :data:`RESOURCE_ERRNOS` that ``exc`` is or was raised from (its
    ``__cause__``/``__context__`` chain), else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in RESOURCE_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def describe(exc: BaseException) -> str:
    """``Type: message`` for stderr and the termination log; a resource exhaustion says so
    first, with its errno's name, so that nobody reads it as a user error."""
    text = f"{type(exc).__name__}: {exc}"
    if (oserr := exhausted(exc)) is not None and oserr.errno is not None:
        name = errno.errorcode.get(oserr.errno, str(oserr.errno))
        return f"resource exhausted ({name}: {os.strerror(oserr.errno)}), retryable: {text}"
    return text


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for an exception that ended training."""
    if exhausted(exc) is not None:
        return EXIT_RETRYABLE
    if isinstance(exc, RingtrainError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_TERMINATED
    return 1
