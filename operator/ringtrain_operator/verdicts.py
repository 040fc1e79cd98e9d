"""What the API server's answer to a create means for the job: done, someone else's, or never.

Pipeline position: :mod:`.reconcile` creates what the fold decided, through :mod:`.kube`, and
judges each answer here (pure functions; the reconcile reads the object a 409 met). Issue 35:

- **409 AlreadyExists, the object controlled by this job** (its controller ownerReference has
  the job's uid): done. The reconciler repeats creates after a crash, so its own objects answer
  409 and are adopted, as before.
- **409, the object someone else's**: the job fails (:class:`Refused`, reason
  :data:`REASON_RESOURCE_EXISTS`) naming it, as mpi-operator refuses with ``ErrResourceExists``.
  Adopting it mounted a planter's SSH key or hostfile in the job's pods, and a planted pod's
  exit was read as the job's. Not while it goes away, though: an object being deleted, or one
  controlled by an earlier TrainingJob of this name (the garbage collector removes it), is
  waited for (:class:`Waiting`, an ``ApiException``: the caller's retry with backoff).
- **A permanent refusal** (:func:`refusal`: 400, 403 but a quota's, 404, 422 and the other 4xx
  but 408 and 429): the same create would be refused for ever, so the job fails with the API
  server's own message (reason :data:`REASON_CREATE_REFUSED`) instead of a retry loop.
- Anything else (5xx, timeouts, throttling, an exhausted quota) is retried with backoff.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes.client import ApiException

from . import manifests
from .job import KIND

#: The job's Failed reason when an object under its names is not its own (mpi-operator's).
REASON_RESOURCE_EXISTS = "ResourceExists"
#: The job's Failed reason when the API server refuses for good an object the operator creates.
REASON_CREATE_REFUSED = "CreateRefused"
#: Longest API server message carried into the job's condition and Event.
MAX_MESSAGE = 1000
#: 4xx answers that are not a verdict on the object: a timeout, throttling (and 409, which
#: :func:`adopt` judges).
TRANSIENT_4XX = (408, 409, 429)


class Refused(Exception):
    """The job cannot go on: its Failed condition's ``reason`` and ``message``. ``events``: the
    Events of what the reconcile did before (pods created), for its decision."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.events: tuple[Any, ...] = ()


class Waiting(ApiException):
    """An object under the job's names that is going away: retried, never adopted."""

    def __init__(self, message: str) -> None:
        super().__init__(status=409, reason=message)


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')} {meta.get('namespace')}/{meta.get('name')}"


def _owner(found: Mapping[str, Any]) -> str:
    ref = manifests.controller_ref(found)
    if ref is None:
        return "no controller"
    return (
        f"controller {str(ref.get('kind'))[:63]} {str(ref.get('name'))[:253]} "
        f"(uid {str(ref.get('uid'))[:64]})"
    )


def adopt(ours: Mapping[str, Any], found: Mapping[str, Any] | None) -> None:
    """Judge the object a create of ``ours`` met (409; ``found`` as read, None if it is gone
    since): return if it is the job's own, raise :class:`Refused` if it is someone else's,
    :class:`Waiting` while it goes away."""
    if found is None:
        raise Waiting(f"{_name(ours)} answered 409 AlreadyExists, then was gone: created again")
    mine, theirs = manifests.controller_ref(ours) or {}, manifests.controller_ref(found) or {}
    if theirs.get("uid") == mine.get("uid"):
        return
    # an earlier TrainingJob of this name: the garbage collector deletes what it controlled
    predecessor = theirs.get("kind") == KIND and theirs.get("name") == mine.get("name")
    if (found.get("metadata") or {}).get("deletionTimestamp") or predecessor:
        raise Waiting(
            f"{_name(ours)} exists and is going away ({_owner(found)}): waiting to create it"
        )
    raise Refused(
        REASON_RESOURCE_EXISTS,
        f"{_name(ours)} already exists and is not owned by this TrainingJob (uid "
        f"{mine.get('uid')}; it has {_owner(found)}): the operator adopts only what it "
        "created. Delete it, or give the job another name",
    )


def api_message(body: Any, fallback: str = "") -> str:
    """The ``message`` of a Status the API server answered (bounded), else ``fallback``."""
    try:
        doc = json.loads(body) if isinstance(body, (str, bytes, bytearray)) else None
    except ValueError:
        doc = None
    message = doc.get("message") if isinstance(doc, dict) else None
    text = message if isinstance(message, str) and message else fallback
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def refusal(obj: Mapping[str, Any], status: int | None, reason: str, body: Any) -> Refused | None:
    """The job's failure when a create of ``obj`` answered ``status`` for good; None when it
    may succeed later (5xx, no answer, 408, 409, 429, a namespace's exhausted quota)."""
    if status is None or not 400 <= status < 500 or status in TRANSIENT_4XX:
        return None
    message = api_message(body, f"{status} {reason}".strip())
    if status == 403 and "exceeded quota" in message:
        return None  # the namespace's ResourceQuota: room may come back
    return Refused(
        REASON_CREATE_REFUSED,
        f"the API server refused to create {_name(obj)} ({status} {reason}): {message}",
    )
