"""What a trainer tells the world while it trains: its events, its ``/status``, and their one
human rendering.

Pipeline position: the shared contract. The worker builds :class:`Progress`, :class:`Eval` and
:class:`Final`, the evaluator :class:`Evaluation` and :class:`Final`, and each prints them
(``--json``: :meth:`to_dict` as one line; otherwise :func:`format_event`); the final one is
also its termination message. Its metrics server answers ``/status`` with a :class:`Status`.
The operator reads ``/status`` and the termination message,
``ringtrain run`` reads the chief's stdout and ``/status`` — both through this module, so a field
is named in one place. The JSON keys are the field names (docs/contracts.md), unchanged since
the dicts these classes replace.

Reading is lenient (:func:`parse`, ``from_dict``): unknown keys are ignored and a missing key
reads as None, so a runner and a trainer of neighbouring versions still understand each other.
This module imports nothing of ringtrain's, so the trainer image and the operator both can.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="_Record")
#: values by the name Keras reports them under (``{"auc": 0.91}``, ``{"cls_loss": 0.41}``)
Values = dict[str, float]
#: a nested JSON object passed through as the trainer built it (memory report, optimizer, …)
Document = dict[str, Any]


class _Record:
    """``to_dict``/``from_dict`` shared by the records below: keys = field names, in order."""

    #: the ``"event"`` tag written first, or None for a document that is not an event
    KIND: ClassVar[str | None] = None
    #: fields added after the wire format was pinned: left out while None, so a document that
    #: does not use them keeps its bytes
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        body = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]  # every subclass is a dataclass
            if f.name not in self.OPTIONAL or getattr(self, f.name) is not None
        }
        return {"event": self.KIND, **body} if self.KIND else body

    def to_json(self) -> str:
        """One compact JSON line, as the worker prints it and writes its termination log."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls: type[T], doc: Mapping[str, Any]) -> T:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # as above
        return cls(**{name: doc.get(name) for name in names})


@dataclasses.dataclass(frozen=True)
class Progress(_Record):
    """The chief after a step (at most once a second, and after the first and the last)."""

    KIND: ClassVar[str] = "progress"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("outputs",)
    step: int | None
    epoch: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    total_steps: int | None = None
    #: a model with several outputs: each output's value by Keras' history name
    #: (``<output>_loss``; after an evaluation also ``<output>_accuracy`` / ``<output>_mae``)
    outputs: Values | None = None


@dataclasses.dataclass(frozen=True)
class Eval(_Record):
    """The chief after an evaluation of the whole test set."""

    KIND: ClassVar[str] = "eval"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("test_mae", "test_metrics", "outputs")
    step: int | None
    test_accuracy: float | None
    #: a regression loss's metric (mean absolute error) in place of ``test_accuracy``
    test_mae: float | None = None
    #: the compiled metrics beyond accuracy/MAE, by Keras' names (``Status.test_metrics``)
    test_metrics: Values | None = None
    #: a model with several outputs: each output's value by Keras' history name
    #: (``<output>_loss``; after an evaluation also ``<output>_accuracy`` / ``<output>_mae``)
    outputs: Values | None = None


@dataclasses.dataclass(frozen=True)
class Evaluation(_Record):
    """The evaluator (``TF_CONFIG`` task type ``evaluator``) after evaluating one checkpoint on
    the whole test split."""

    KIND: ClassVar[str] = "evaluation"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("test_mae", "test_metrics", "outputs")
    step: int | None
    test_loss: float | None = None
    test_accuracy: float | None = None
    checkpoint: str | None = None
    test_mae: float | None = None
    test_metrics: Values | None = None
    #: a model with several outputs: each output's value by Keras' history name
    #: (``<output>_loss``; after an evaluation also ``<output>_accuracy`` / ``<output>_mae``)
    outputs: Values | None = None


@dataclasses.dataclass(frozen=True)
class Final(_Record):
    """Every worker's last line and termination message: how its training ended.

    The evaluator's too: ``steps`` is then the step of the last checkpoint it evaluated,
    ``test_loss``/``test_accuracy`` that checkpoint's, ``evaluations`` how many it evaluated.
    ``export`` is where the chief wrote the trained model (``--export``)."""

    KIND: ClassVar[str] = "final"
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "test_loss",
        "evaluations",
        "export",
        "trace",
        "params_sha256",
        "test_mae",
        "outputs",
        "test_outputs",
        "skipped_steps",
    )
    steps: int | None
    epoch: int | None = None
    loss: float | None = None
    test_accuracy: float | None = None
    samples_per_s: float | None = None
    checkpoint: str | None = None
    rank: int | None = None
    world_size: int | None = None
    terminated: bool | None = None
    test_loss: float | None = None
    evaluations: int | None = None
    export: str | None = None
    #: the chief: the merged timeline of ``--trace-steps`` (trace.json), when one was recorded
    trace: str | None = None
    #: every trainer: SHA-256 of its final weights, so a job's workers can be seen to agree
    params_sha256: str | None = None
    #: a regression loss's metric (mean absolute error) in place of ``test_accuracy``
    test_mae: float | None = None
    #: a model with several outputs: each output's value by Keras' history name
    #: (``<output>_loss``; after an evaluation also ``<output>_accuracy`` / ``<output>_mae``)
    outputs: Values | None = None
    #: a model with several outputs: the last evaluation's values per output (Keras' names)
    test_outputs: Values | None = None
    #: dynamic loss scaling: the steps skipped for a non-finite reduced gradient (within the
    #: bounds of ``ringtrain_trainer.divergence``, or the job failed)
    skipped_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Status(_Record):
    """A worker's ``/status`` document (no ``"event"`` key): its latest step, at any moment.

    The evaluator's: ``step`` is the last evaluated checkpoint's, ``phase`` ``Evaluating``."""

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "test_loss",
        "waiting_for",
        "stalled",
        "ipu_memory",
        "optimizer",
        "loss_fn",
        "test_mae",
        "numerics",
        "accumulation",
        "test_metrics",
        "outputs",
        "test_outputs",
        "data_wait_s",
        "ring_size",
        "resize_step",
        "resize_s",
    )
    step: int | None = 0
    epoch: float | None = 0
    loss: float | None = None
    samples_per_s: float | None = None
    test_accuracy: float | None = None
    phase: str | None = "Starting"
    test_loss: float | None = None
    #: at start-up, the ring members (task names, ``worker-2``) that have not answered yet
    waiting_for: list[str] | None = None
    #: a collective waiting past the stall threshold: its seq, step, tag, waited_s and the
    #: ranks that have not delivered (``missing``: rank, name, where it is); None otherwise
    stalled: Document | None = None
    #: the training program's memory report, per IPU: ``capacity``, ``total``, ``kinds``
    #: (bytes by kind), ``layers`` (one row per layer, then ``(input)`` and ``(loss)``) and
    #: ``host`` (``optimizer_state`` held on the host); None until the program is compiled
    ipu_memory: Document | None = None
    #: the optimizer that runs (Keras serialization, its source: the model's compile settings
    #: or the flags that replaced them); None until the trainer is built
    optimizer: Document | None = None
    #: the loss that runs (``engine.loss_spec.LossSpec.record``: Keras serialization, summary);
    #: None until the trainer is built
    loss_fn: Document | None = None
    #: a regression loss's metric (mean absolute error) in place of ``test_accuracy``
    test_mae: float | None = None
    #: precision, stochastic rounding and the loss scale now (``numerics.Numerics.record``)
    numerics: Document | None = None
    #: gradient accumulation steps (micro-batches per optimizer step)
    accumulation: int | None = None
    #: the model's compiled metrics beyond accuracy/MAE (``engine.keras_metrics``), by the
    #: name Keras reports them under (``{"auc": 0.91}``); None without any
    test_metrics: Values | None = None
    #: a model with several outputs: the last step's loss per output (``<output>_loss``)
    outputs: Values | None = None
    #: a model with several outputs: the last evaluation's values per output (Keras' names)
    test_outputs: Values | None = None
    #: seconds the last step waited for its batch's data (``ringtrain_data_wait_seconds``);
    #: near 0 while reading from shards stays hidden behind the step
    data_wait_s: float | None = None
    #: the workers in this process's ring: what an elastic job's resize is seen done by
    ring_size: int | None = None
    #: an elastic job's worker re-formed in a resize: the step it went on from, and the
    #: seconds from its first sight of the new size to the new ring formed
    resize_step: int | None = None
    resize_s: float | None = None


Event = Progress | Eval | Evaluation | Final
EVENTS: dict[str, type[Progress] | type[Eval] | type[Evaluation] | type[Final]] = {
    c.KIND: c for c in (Progress, Eval, Evaluation, Final)
}


def parse(doc: Any) -> Event | None:
    """A decoded JSON line → its event; None for anything else (a log line, an error record)."""
    if not isinstance(doc, Mapping):
        return None
    cls = EVENTS.get(str(doc.get("event")))
    return cls.from_dict(doc) if cls is not None else None


def parse_line(line: str) -> Event | None:
    """One line of a worker's stdout → its event, or None when it is not one (a log line)."""
    if not line.startswith("{"):
        return None
    try:
        return parse(json.loads(line))
    except ValueError:
        return None


#: The most a ``/status`` reply (header and body) may hold: a real one is a few KiB, the memory
#: report's per-layer table included. The reader never holds more, and refuses a larger reply.
STATUS_MAX_BYTES = 1 << 20


class StatusRefused(ValueError):
    """A ``/status`` reply that was answered but is no status document: too slow in all, too
    large, not HTTP 200, not a JSON object (issue 20: the tenant chooses the image)."""


def read_status(url: str, timeout_s: float = 1.0, max_bytes: int = STATUS_MAX_BYTES) -> Status:
    """A worker's ``/status`` at ``url`` (``http://host:port/path``), read within ``timeout_s``
    *in all* — connecting, asking and every byte of the reply: a reply that drips one byte per
    timeout never ends a per-read timeout — holding at most ``max_bytes``. :class:`OSError` when
    nothing answers, :class:`StatusRefused` saying why when what answers is no status."""
    u = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        s = deadline - time.monotonic()
        if s <= 0:
            raise StatusRefused(f"no complete reply within {timeout_s:g} s")
        return s

    with socket.create_connection((u.hostname or "", u.port or 80), timeout=left()) as sock:
        sock.sendall(f"GET {u.path or '/'} HTTP/1.0\r\nHost: {u.hostname}\r\n\r\n".encode())
        buf = bytearray()
        while len(buf) <= max_bytes:
            sock.settimeout(left())
            try:
                chunk = sock.recv(min(1 << 16, max_bytes + 1 - len(buf)))
            except TimeoutError:
                raise StatusRefused(f"no complete reply within {timeout_s:g} s") from None
            if not chunk:
                break
            buf += chunk
        else:
            raise StatusRefused(f"reply larger than {max_bytes} bytes")
    head, sep, body = bytes(buf).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise StatusRefused("not an HTTP reply")
    if status_line[1] != b"200":
        raise StatusRefused(f"HTTP {status_line[1][:3].decode('latin-1')}")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: ``[[[[…`` nested 10⁵ deep
        raise StatusRefused(f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, Mapping):
        raise StatusRefused(f"a JSON {type(doc).__name__}, not an object")
    return Status.from_dict(doc)


def fetch_status(url: str, timeout_s: float = 1.0) -> Status | None:
    """A worker's ``/status`` at ``url``; None when it does not answer (yet) or not with a status
    document (:func:`read_status`, bounded in time and bytes)."""
    try:
        return read_status(url, timeout_s)
    except (OSError, StatusRefused):
        return None


# ---- the one human rendering -------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def _number(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _metric(e: Eval | Evaluation | Final) -> str:
    """``test accuracy 0.8696``, or ``test MAE 0.1234`` after a regression loss."""
    if e.test_mae is not None:
        return f"test MAE {_number(e.test_mae, '.4f')}"
    return f"test accuracy {_number(e.test_accuracy, '.4f')}"


def _compiled(metrics: Values | None) -> str:
    """The compiled metrics after the accuracy: ``  auc 0.9132  precision 0.8750``."""
    return "".join(f"  {k} {v:.4f}" for k, v in (metrics or {}).items())


def _outputs(values: Values | None) -> list[str]:
    """``cls_loss 0.4123``, one per output value of a model with several outputs."""
    return [f"{k} {_number(v, '.4f')}" for k, v in (values or {}).items()]


def format_event(e: Event) -> str:
    """One line for people.

    ``step 120/500 (24%)  epoch 0  loss 0.4123  8,412 samples/s  ETA 0:45``;
    ``step 500  test accuracy 0.9012``;
    ``checkpoint step 500  test loss 0.2811  test accuracy 0.9012`` (the evaluator);
    ``done: 500 steps, loss 0.2101, test accuracy 0.9012, 8,300 samples/s, checkpoint …``.
    A field not known yet is left out of a progress line.
    """
    if isinstance(e, Progress):
        parts = []
        if e.step is None:
            parts.append("starting")
        elif e.total_steps:
            parts.append(f"step {e.step}/{e.total_steps} ({100 * e.step // e.total_steps}%)")
        else:
            parts.append(f"step {e.step}")
        if e.epoch is not None:
            parts.append(f"epoch {e.epoch:g}")
        if e.loss is not None:
            parts.append(f"loss {e.loss:.4f}")
        if e.samples_per_s is not None:
            parts.append(f"{e.samples_per_s:,.0f} samples/s")
        if e.eta_s is not None:
            parts.append(f"ETA {duration(e.eta_s)}")
        return "  ".join(parts + _outputs(e.outputs))
    if isinstance(e, Eval):
        return "  ".join(
            [f"step {e.step}  {_metric(e)}{_compiled(e.test_metrics)}", *_outputs(e.outputs)]
        )
    if isinstance(e, Evaluation):
        return (
            f"checkpoint step {e.step}  test loss {_number(e.test_loss, '.4f')}  {_metric(e)}"
            + _compiled(e.test_metrics)
        )
    if e.evaluations is not None:
        return (
            f"done: evaluated {e.evaluations} checkpoints, last step {e.steps}, test loss "
            f"{_number(e.test_loss, '.4f')}, {_metric(e)}"
        )
    return (
        f"done: {e.steps} steps, loss {_number(e.loss, '.4f')}, {_metric(e)}, "
        f"{_number(e.samples_per_s, ',.0f')} samples/s"
        + (f", checkpoint {e.checkpoint}" if e.checkpoint else "")
        + (f", export {e.export}" if e.export else "")
    )
