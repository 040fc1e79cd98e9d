"""Events about TrainingJobs: aggregated per reconcile, posted off the reconcile path.

A reconcile's Events of the same type and reason are one Event whose ``count`` says how many
happened, as Kubernetes' own event aggregation records repeats (client-go's EventCorrelator):
a 2-worker job's first reconcile posts ``TrainingJobCreated`` and one ``PodCreated`` with count 2
("created pods j-worker-0, j-worker-1") instead of three Events; summing ``count`` still gives one
per pod. They are posted by the operator's own small pool with the same API client as every other
call (kopf's poster ran an asyncio task and an aiohttp request per Event on the loop that also
watches; issue 22). An Event that cannot be posted is logged and dropped: Events are auxiliary,
they never fail or delay a reconcile.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from . import status
from .job import GROUP, VERSION

log = logging.getLogger(__name__)

#: The Events' source (``kubectl describe``'s "From" column).
COMPONENT = "ringtrain-operator"
#: The API server refuses longer messages.
MESSAGE_MAX = 1024
#: Threads posting Events: each post is one round trip; Events of one reconcile stay in order.
#: Half the reconcile pool: a new job posts 2 Events against its 4 creates.
THREADS = 8

_POOL = ThreadPoolExecutor(THREADS, "events")


def aggregate(events: Iterable[status.Event]) -> list[tuple[status.Event, int]]:
    """Events of the same type and reason as one, in order of first appearance, with their
    count; the messages joined (``created pod a`` + ``created pod b`` → ``created pods a, b``)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for ev in events:
        groups.setdefault((ev.type, ev.reason), []).append(ev.message)
    return [
        (status.Event(type_, reason, _join(messages)), len(messages))
        for (type_, reason), messages in groups.items()
    ]


def _join(messages: list[str]) -> str:
    """``created pod a``, ``created pod b`` → ``created pods a, b`` (a shared ``… pod`` head);
    other messages are joined with ``; ``."""
    if len(messages) == 1:
        return messages[0]
    heads = {m.rpartition(" ")[0] for m in messages}
    if len(heads) == 1 and (head := heads.pop()).endswith(" pod"):
        return f"{head}s " + ", ".join(m.rpartition(" ")[2] for m in messages)
    return "; ".join(messages)


def event_body(
    ref: Mapping[str, str], ev: status.Event, count: int, now: datetime | None = None
) -> dict[str, Any]:
    """A core/v1 Event about the job ``ref`` (namespace, name, uid)."""
    stamp = (now or datetime.now(UTC)).isoformat()
    message = ev.message
    if len(message) > MESSAGE_MAX:
        message = f"{message[: MESSAGE_MAX // 2 - 2]}...{message[-(MESSAGE_MAX // 2 - 1) :]}"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "namespace": ref["namespace"],
            "name": f"{ref['name']}.{uuid.uuid4().hex[:16]}",
        },
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingJob",
            "namespace": ref["namespace"],
            "name": ref["name"],
            "uid": ref["uid"],
        },
        "type": ev.type,
        "reason": ev.reason,
        "message": message,
        "count": count,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
    }


def post(kube: Any, ref: Mapping[str, str], events: Iterable[status.Event]) -> None:
    """Queue a reconcile's Events about the job ``ref`` for posting, aggregated (the bodies are
    built when posted: a backlog holds the few strings of each, not whole Events)."""
    if groups := aggregate(events):
        _POOL.submit(_post_all, kube, ref, groups)


def _post_all(kube: Any, ref: Mapping[str, str], groups: list[tuple[status.Event, int]]) -> None:
    for ev, n in groups:
        try:
            kube.create_event(ref["namespace"], event_body(ref, ev, n))
        except Exception as e:  # noqa: BLE001 (auxiliary: logged, never raised)
            log.warning("%s/%s: Event %s not posted: %s", ref["namespace"], ref["name"],
                        ev.reason, e)  # fmt: skip
