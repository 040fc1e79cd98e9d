"""What a worker tells people and machines while it trains: event fields, the reporter, throughput.

Split out of :mod:`ringtrain_trainer.worker` so the training loop reads as steps, not formatting;
the event schema itself lives in :mod:`ringtrain.events`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from ringtrain import events


def metric_fields(metric: str, value: float | None) -> dict:
    """An event's ``test_accuracy``, or its ``test_mae`` after a regression loss."""
    v = None if value is None else round(value, 6)
    return {"test_accuracy": None, "test_mae": v} if metric == "mae" else {"test_accuracy": v}


def outputs_field(values: dict | None) -> dict:
    return {} if values is None else {"outputs": values}


#: seconds between progress lines
PROGRESS_EVERY_S = 1.0


class Reporter:
    """Progress for people (:func:`events.format_event`) or machines (one JSON object per line).

    Only the chief reports progress; every worker prints its final line, so each pod's log
    ends with that worker's result."""

    def __init__(self, as_json: bool, out: TextIO, chief: bool = True):
        self.as_json, self.out, self.chief = as_json, out, chief

    def emit(self, event: events.Event) -> None:
        if not self.chief and not isinstance(event, events.Final):
            return
        line = event.to_json() if self.as_json else events.format_event(event)
        print(line, file=self.out, flush=True)


@dataclass
class Throughput:
    """Samples/s and ETA from an exponential moving average of step time."""

    ema_s: float = 0.0

    def update(self, seconds: float) -> float:
        self.ema_s = seconds if self.ema_s == 0.0 else 0.9 * self.ema_s + 0.1 * seconds
        return self.ema_s
