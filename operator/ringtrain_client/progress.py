"""The progress line ``wait()`` shows while a job runs: in a notebook, in a terminal, or nowhere.

Pipeline position: :meth:`.client.TrainerClient.wait_for_job` polls the job's status and hands
each look to a :class:`Display`. The line is the one ``ringtrain run`` draws
(:func:`ringtrain_localrun.console.format_progress`, itself the trainer's own rendering), so a
notebook, ``ringtrain wait`` and ``ringtrain run`` read alike: ``step 120/500 (24%)  loss 0.4123
8,412 samples/s  ETA 0:45  acc 91.20% at step 100  [worker-0 ok worker-1 ok]``.

Where it goes, chosen once when the wait starts (as Keras' ``verbose="auto"`` chooses):

- in a Jupyter kernel, one ``display(..., display_id=True)`` output updated in place
  (``update_display_data``: the cell keeps one line, not one per poll);
- on a terminal, one line redrawn with a carriage return, ended by a newline;
- elsewhere (a log file, a pipe, pytest) nothing — unless asked for with ``progress=True``,
  then a line when it changed, at most every :data:`PLAIN_INTERVAL_S` (``ringtrain run``'s
  own pace when its stdout is not a terminal), and the last one.

No dependency: IPython is used only when a kernel has already imported it.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from ringtrain_localrun.console import format_progress

from .jobs import JobStatus

#: seconds between plain progress lines (``progress=True`` on a stream that is not a terminal)
PLAIN_INTERVAL_S = 5.0


def from_status(st: JobStatus) -> dict[str, Any]:
    """The progress fields a :class:`JobStatus` knows, as ``ringtrain run``'s progress event
    names them — the line of a backend that has no such events (a cluster's TrainingJob)."""
    return {
        "step": st.step,
        "total_steps": st.total_steps,
        "loss": st.loss,
        "test_accuracy": st.test_accuracy,
        "restarts": st.restarts,
    }


def _kernel_shell() -> Any:
    """The running IPython kernel's shell, or None (a terminal IPython has no ``kernel``: it
    draws like any terminal)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


class Display:
    """Shows successive progress lines in one place; :meth:`close` leaves the last one."""

    def __init__(self, mode: str, out: TextIO, clock: Any = time.monotonic):
        self.mode, self.out, self.clock = mode, out, clock
        self.line = ""
        self._handle: Any = None
        self._shown_s = float("-inf")

    def update(self, p: Mapping[str, Any], final: bool = False) -> None:
        line = format_progress(p)
        if line == self.line and not final:
            return
        self.line = line
        if self.mode == "notebook":
            from IPython.display import Pretty, display

            if self._handle is None:
                self._handle = display(Pretty(line), display_id=True)
            else:
                self._handle.update(Pretty(line))
        elif self.mode == "terminal":
            width = shutil.get_terminal_size((120, 20)).columns - 1
            self.out.write("\r\x1b[2K" + line[:width])
            self.out.flush()
        else:
            now = self.clock()
            if final or now - self._shown_s >= PLAIN_INTERVAL_S:
                self._shown_s = now
                self.out.write(f"progress  | {line}\n")
                self.out.flush()

    def close(self) -> None:
        if self.mode == "terminal" and self.line:
            self.out.write("\n")
            self.out.flush()


def display_for(progress: bool | None, out: TextIO | None = None) -> Display | None:
    """The :class:`Display` for ``wait(progress=...)``: ``None`` picks a notebook or a terminal
    when there is one and shows nothing otherwise, ``True`` shows plain lines where neither
    is, ``False`` shows nothing."""
    if progress is False:
        return None
    stream = out if out is not None else sys.stdout
    if _kernel_shell() is not None:
        return Display("notebook", stream)
    if stream.isatty():
        return Display("terminal", stream)
    return Display("plain", stream) if progress else None
