"""Where `ringtrain run` writes: replica logs, the live progress line, JSON events, the summary.

Pipeline position: the supervisor and the CLI write through :class:`Output`; every line about
a replica's progress is rendered by :func:`ringtrain.events.format_event`, the trainer's own.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Mapping
from typing import Any, TextIO

from ringtrain import events
from ringtrain.errors import EXIT_RETRYABLE
from ringtrain_operator import status

from .logs import label_of


def format_progress(p: Mapping[str, Any]) -> str:
    """One human line: the chief's progress as the trainer itself renders it
    (:func:`events.format_event`), then what only the runner knows:
    ``step 120/500 (24%)  loss 0.4123  8,412 samples/s  ETA 0:45  acc 91.20% at step 100
    [health]`` (the accuracy is the last evaluation's, so the line says when it ran)."""
    parts = [events.format_event(events.Progress.from_dict(p))]
    if p.get("test_accuracy") is not None:
        at = p.get("test_accuracy_step")
        when = f" at step {at}" if at is not None else ""
        parts.append(f"acc {100 * p['test_accuracy']:.2f}%{when}")
    if p.get("restarts"):
        parts.append(f"restarts {p['restarts']}")
    health = " ".join(f"{k} {v}" for k, v in (p.get("workers") or {}).items())
    return "  ".join(parts) + (f"  [{health}]" if health else "")


class Output:
    """Where the runner writes: replica logs, the live progress line, events, the summary.

    Human mode redraws one progress line at the bottom of a terminal (or prints it every few
    seconds when stdout is not one); ``--json`` writes one object per line on stdout and the
    replicas' logs, prefixed, on stderr.
    """

    def __init__(self, json_mode: bool, out: TextIO, err: TextIO, interval_s: float = 5.0):
        self.json_mode, self.out, self.err = json_mode, out, err
        self.live = not json_mode and out.isatty()
        self.interval_s = interval_s if not self.live else 0.2
        self._last_progress_s = float("-inf")
        self._line = ""
        self._lock = threading.Lock()

    def _clear(self) -> None:
        if self.live and self._line:
            self.out.write("\r\x1b[2K")

    def log(self, label: str, line: str) -> None:
        with self._lock:
            self._clear()
            stream = self.err if self.json_mode else self.out
            stream.write(f"{label:<10}| {line}\n")
            stream.flush()
            if self.live and self._line:
                self.out.write(self._line)
                self.out.flush()

    def event(self, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if self.json_mode:
                self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")
                self.out.flush()

    def progress(self, p: Mapping[str, Any], now_s: float, force: bool = False) -> None:
        if not force and now_s - self._last_progress_s < self.interval_s:
            return
        self._last_progress_s = now_s
        if self.json_mode:
            self.event(p)
            return
        with self._lock:
            line = format_progress(p)
            if self.live:
                self._line = line[: shutil.get_terminal_size((120, 20)).columns - 1]
                self.out.write("\r\x1b[2K" + self._line)
            else:
                self.out.write(f"progress  | {line}\n")
            self.out.flush()

    def message(self, text: str) -> None:
        if not self.json_mode:
            with self._lock:
                self._clear()
                self.out.write(text + "\n")
                self._line = ""
                self.out.flush()


def format_summary(s: Mapping[str, Any]) -> str:
    """The closing block of a human run: outcome, why, the chief's final numbers, where to look."""
    failed = s["phase"] != status.SUCCEEDED
    reason = f" ({s['reason']})" if failed and s.get("reason") else ""
    lines = [f"TrainingJob {s['job']}: {s['phase']}{reason}"]
    if failed and s.get("message"):
        lines.append(f"  why            {s['message']}")
    if s.get("restarts"):
        lines.append(f"  restarts       {s['restarts']}")
    if s.get("steps") is not None:
        lines.append(f"  steps          {s['steps']}")
    if s.get("skipped_steps"):
        lines.append(f"  skipped steps  {s['skipped_steps']} (non-finite float16 gradient)")
    if s.get("loss") is not None:
        lines.append(f"  last loss      {s['loss']:.4f} (the last step's batch)")
    if s.get("test_accuracy") is not None:
        lines.append(f"  test accuracy  {100 * s['test_accuracy']:.2f}%")
    if s.get("samples_per_s") is not None:
        lines.append(f"  samples/s      {s['samples_per_s']:,.0f}")
    lines.append(f"  time           {events.duration(s['elapsed_s'])}")
    if s.get("checkpoint"):
        lines.append(f"  checkpoint     {s['checkpoint']}")
    if s.get("export"):
        lines.append(f"  export         {s['export']}")
    if s.get("evaluations"):
        last = s["evaluations"][-1]
        lines.append(
            f"  evaluator      {len(s['evaluations'])} checkpoints, last step "
            f"{last['step']}: test loss {last['test_loss']:.4f}, accuracy "
            f"{100 * last['test_accuracy']:.2f}%"
        )
    if s.get("trace"):
        lines.append(f"  trace          {s['trace']}  (open in https://ui.perfetto.dev)")
    lines.append(f"  logs and data  {s['run_dir']}")
    if failed and (culprit := _culprit(s)):
        lines.append(f"  its log        ringtrain logs {s['run_dir']} --replica {culprit}")
    codes = " ".join(f"{k}={v}" for k, v in s["exit_codes"].items())
    lines.append(f"  exit codes     {codes}")
    return "\n".join(lines)


def _culprit(s: Mapping[str, Any]) -> str | None:
    """The replica whose failure ended the job: the pod the message names, else the first exit
    that is not a peer leaving (0, 138 for a broken ring, 143 for being stopped)."""
    if m := re.match(r"pod (\S+) failed", s.get("message") or ""):
        return label_of(m.group(1))
    return next(
        (k for k, v in s["exit_codes"].items() if v not in (None, 0, EXIT_RETRYABLE, 143)), None
    )
