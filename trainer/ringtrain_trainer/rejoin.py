"""A survivor of a peer's failure rejoins the ring in its own container, by re-executing itself.

Why: a gang restart used to be every member exiting 138 and its kubelet restarting the container.
The kubelet's crash back-off (10 s, 20 s, ... 5 min, per container, never reset within 10 min)
then hit *every* member on every failure, so ten kills of one worker kept the whole gang waiting
≈ 28 min (docs/reliability.md). Horovod's elastic mode and torchrun's agent keep the survivors'
containers instead; here the survivor replaces its process image with a fresh one
(``os.execve``, same PID, same container, same ``emptyDir``): no thread, socket or half-finished
collective of the broken ring survives an exec, so the new process is exactly the one the kubelet
would have started — it rendezvouses, the chief resumes from its checkpoint and broadcasts.
Only the failed member's container restarts, so only it pays the kubelet's back-off and counts
against ``backoffLimit`` (one failure, one restart).

What keeps this bounded: only a retryable :class:`RingError` qualifies, and not a
:class:`PeerTimeout` before the ring formed — a rendezvous or connect deadline that passed exits
138 as before, so a peer that never comes back ends in the kubelet's hands and in
``backoffLimit``. Other failures while the ring forms do qualify: a peer restarting at the same
moment can answer the rendezvous from its leaving predecessor, whose side-channel key the
successor then refuses, or abort it; a fresh rendezvous sorts that out. At most
``--ring-rejoin-limit`` rejoins in a row may happen without a completed step in between (0:
never rejoin, exit 138).
The count travels to the new process in :data:`ENV`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ringtrain.errors import EXIT_RETRYABLE, PeerTimeout, RingError

#: ``total,streak,step`` of the previous rejoins of this container, set for the re-executed process.
ENV = "RINGTRAIN_REJOIN"


@dataclass(frozen=True)
class Rejoins:
    """This container's rejoins so far: in all, in a row without progress, and the step the
    last one left at."""

    total: int = 0
    streak: int = 0
    step: int = -1

    @classmethod
    def from_env(cls, environ=os.environ) -> Rejoins:
        """Garbage or absence is "no rejoin yet": the variable is ours, never the user's."""
        try:
            total, streak, step = (int(v) for v in environ.get(ENV, "").split(","))
        except ValueError:
            return cls()
        return cls(max(total, 0), max(streak, 0), step)

    def after(self, step: int) -> Rejoins:
        """The count once this process, having reached ``step``, rejoins."""
        return Rejoins(self.total + 1, 1 if step > self.step else self.streak + 1, step)


def decide(
    error: BaseException, *, ring_formed: bool, step: int | None, limit: int, previous: Rejoins
) -> Rejoins | None:
    """The rejoin to make instead of exiting, or None (exit with the error's code). ``step``:
    the trainer's, None before there is a trainer."""
    if not (isinstance(error, RingError) and error.exit_code == EXIT_RETRYABLE):
        return None
    if not ring_formed and isinstance(error, PeerTimeout):
        return None
    nxt = previous.after(-1 if step is None else step)
    return nxt if nxt.streak <= limit else None


def exec_again(rejoins: Rejoins) -> None:
    """Replace this process with the same command line (never returns). Python's own sockets and
    grpcio's are close-on-exec, so the ports are free for the new image at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, **{ENV: f"{rejoins.total},{rejoins.streak},{rejoins.step}"})
    os.execve(sys.executable, list(sys.orig_argv), env)
