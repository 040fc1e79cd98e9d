"""``wait()``'s progress line (ringtrain_client.progress): where it goes and how often. The line
itself is ``ringtrain run``'s (format_progress); a notebook's display is exercised by a real
kernel in test_tutorial_notebook.py, a real job's plain lines in test_client_local.py, and
``ringtrain wait`` on a real pseudo-terminal here."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess

from support.procs import CLI

from ringtrain_client.jobs import JobStatus
from ringtrain_client.progress import PLAIN_INTERVAL_S, Display, display_for, from_status


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _p(step: int | None, loss: float | None = None) -> dict:
    return {"step": step, "total_steps": 30, "loss": loss}


def test_nothing_is_shown_on_a_plain_stream_unless_asked_for():
    assert display_for(None, io.StringIO()) is None
    assert display_for(False, _Terminal()) is None
    assert display_for(True, io.StringIO()).mode == "plain"
    assert display_for(None, _Terminal()).mode == "terminal"


def test_a_terminal_redraws_one_line_and_ends_it():
    out = _Terminal()
    shown = Display("terminal", out)
    shown.update(_p(None))
    shown.update(_p(10, 0.5))
    shown.update(_p(10, 0.5))  # unchanged: not redrawn
    shown.update(_p(30, 0.25), final=True)
    shown.close()
    draws = out.getvalue().split("\r\x1b[2K")
    assert draws == [
        "",
        "starting",
        "step 10/30 (33%)  loss 0.5000",
        "step 30/30 (100%)  loss 0.2500\n",
    ]


def test_plain_lines_are_spaced_and_the_last_one_is_always_written():
    out, now = io.StringIO(), [0.0]
    shown = Display("plain", out, clock=lambda: now[0])
    shown.update(_p(1, 0.9))
    now[0] = PLAIN_INTERVAL_S / 2
    shown.update(_p(2, 0.8))  # too soon after the first
    now[0] = PLAIN_INTERVAL_S
    shown.update(_p(3, 0.7))
    now[0] += 0.1
    shown.update(_p(30, 0.1), final=True)
    shown.close()
    assert out.getvalue().splitlines() == [
        "progress  | step 1/30 (3%)  loss 0.9000",
        "progress  | step 3/30 (10%)  loss 0.7000",
        "progress  | step 30/30 (100%)  loss 0.1000",
    ]


def test_a_status_without_progress_events_still_makes_the_line():
    st = JobStatus("j", "kubernetes", "Running", step=12, total_steps=30, loss=0.4, restarts=1)
    out = io.StringIO()
    Display("plain", out).update(from_status(st))
    assert out.getvalue() == "progress  | step 12/30 (40%)  loss 0.4000  restarts 1\n"


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """``ringtrain ARGS`` with its stdout on a pseudo-terminal: (exit code, what it showed)."""
    main, sub = pty.openpty()
    try:
        done = subprocess.run(
            [*CLI, *args], stdin=subprocess.DEVNULL, stdout=sub, stderr=subprocess.PIPE, timeout=60
        )
    finally:
        os.close(sub)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the terminal's other end is closed and read out
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    return done.returncode, shown.decode()


def test_ringtrain_wait_draws_the_line_on_a_terminal_but_not_with_json(tmp_path):
    run = tmp_path / "mlp-20261129-120000"
    run.mkdir()
    (run / "job.yaml").write_text("kind: TrainingJob\n")
    final = {"phase": "Succeeded", "steps": 30, "loss": 0.25, "test_accuracy": 0.9}
    (run / "final.json").write_text(json.dumps(final))

    code, shown = _on_a_terminal("wait", run.name, "--root", str(tmp_path))
    assert code == 0 and "\r\x1b[2Kstep 30  loss 0.2500  acc 90.00%\r\n" in shown, shown
    code, shown = _on_a_terminal("wait", run.name, "--json", "--root", str(tmp_path))
    assert code == 0 and "\x1b[2K" not in shown, shown
    assert json.loads(shown)["step"] == 30
