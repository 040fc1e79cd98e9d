"""The rendezvous: every worker registers with every peer until all have answered.

Pipeline position: ``ring.connect`` starts this worker's control plane (``ring.control``), then
calls :func:`rendezvous` — the readiness barrier of the seeds' ``tf.distribute.Server`` — before
the data path connects. A peer that is not serving yet is retried with back-off; a refusal no
retry can cure (the token, a peer of another ring) ends it at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import grpc

from ringtrain.errors import InvalidSpec, PeerTimeout, RingError, Unauthenticated
from ringtrain_trainer.ring.control import SERVICE, ControlPlane, log


def rendezvous(
    plane: ControlPlane,
    timeout_s: float,
    on_waiting: Callable[[list[str]], None] = lambda names: None,
    *,
    elastic: bool = False,
    resized: threading.Event | None = None,
) -> dict:
    """Register with every peer until all answered (the readiness barrier); their answers
    by rank. A peer that is not serving yet, or whose name does not resolve yet (a pod
    whose DNS record is not published), is retried with back-off until ``timeout_s``;
    ``on_waiting`` hears the still-missing names whenever they change ([] at the end). With
    ``elastic`` a peer of another ring size is retried too: in a resize it re-forms its ring at
    this size once it has stopped at the old one; ``resized`` set (the job's size changed while
    the ring formed: ``ringtrain_trainer.elastic``) gives up, retryably, to form it anew."""
    missing = [r for r in range(plane.world) if r != plane.rank]
    answers: dict[int, dict] = {}
    deadline, delay, last = time.monotonic() + timeout_s, 0.05, {}
    reported: list[str] | None = None
    while True:
        if plane.aborted is not None:
            raise plane.aborted
        if resized is not None and resized.is_set():
            raise RingError(
                f"rank {plane.rank}: the job was resized while the ring formed",
                rank=plane.rank,
                step=-1,
            )
        calls = {
            r: plane.channel(r)
            .unary_unary(
                f"/{SERVICE}/Register", request_serializer=None, response_deserializer=None
            )
            .future(
                json.dumps({"incarnation": plane.incarnation}).encode(),
                metadata=plane.metadata(),
                timeout=max(0.2, min(2.0, deadline - time.monotonic())),
            )
            for r in missing
        }
        for r, call in calls.items():
            try:
                answers[r] = json.loads(call.result())
                plane.registered(r, str(answers[r].get("incarnation")))
            except grpc.RpcError as e:
                if not (elastic and e.code() == grpc.StatusCode.INVALID_ARGUMENT):
                    _refused(e, plane.addresses[r], plane.rank)
                last[r] = f"{e.code().name}: {e.details()}"
        missing = [r for r in missing if r not in answers]
        names = [plane.names[r] for r in missing]
        if names != reported:
            reported = names
            on_waiting(names)
            if names:
                log(f"rank {plane.rank}: waiting for {', '.join(names)}")
        if not missing:
            if plane.aborted is not None:
                raise plane.aborted
            return answers
        if time.monotonic() + delay >= deadline:
            first = missing[0]
            raise PeerTimeout(
                f"{', '.join(names)} did not answer within {timeout_s:g} s "
                f"(last error: {last.get(first)})",
                rank=plane.rank,
                step=-1,
                peer=plane.addresses[first],
            )
        time.sleep(delay)  # back-off between rounds
        delay = min(delay * 2, 1.0)


def _refused(e: grpc.RpcError, peer: str, rank: int) -> None:
    """A refusal no retry can cure: the token, or a peer of another ring."""
    code = e.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        raise Unauthenticated(f"{peer} refused the ring token: {e.details()}", rank=rank) from None
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
        raise InvalidSpec(
            f"rank {rank}: {peer} refused: {e.details()} (do all "
            "workers have the same TF_CONFIG cluster?)"
        ) from None
