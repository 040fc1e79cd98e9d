"""The MPI launcher pod's main process: ``mpirun``, with rank 0's result as the pod's result.

``python3 -m ringtrain_operator.mpilaunch [--no-termination-log] mpirun ...`` runs mpirun with
``--tag-output`` (each line of a rank prefixed ``[job,rank]<stdout>:``) and passes its output on
as the chief's would read: rank 0's lines as they are, the other ranks' log lines prefixed with
their rank and their event lines dropped (rank 0's are the job's; two ranks' ``final`` lines
would contradict each other). It keeps rank 0's last final event: rank 0 runs in worker 0,
whose container (sshd) never ends, so its own termination log is never read; the launcher's
is, as a ring chief's is (``ringtrain run`` reads rank 0's own file: --no-termination-log).
The exit status is mpirun's; SIGTERM and SIGINT are passed on to it — but when mpirun could
not start a rank at all (an executable it cannot access or run: exit 132, which restart policies
read as transient), the launcher exits ``EXIT_PERMANENT`` with mpirun's own words as its
termination message: no retry can fix a command line (issue 34).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from ringtrain import events, options
from ringtrain.errors import EXIT_PERMANENT

#: Open MPI's --tag-output prefix, [jobid,rank]<stream>:, which starts every chunk a rank writes
#: (and every line inside a chunk): a chunk without its newline is followed on the same output
#: line by whichever rank's chunk came next (``[1,0]<stdout>:{...}[1,0]<stdout>:`` when rank 0's
#: newline came in a write of its own; ``[1,0]<stdout>:{"ev[1,1]<stdout>:...`` when rank 1's
#: line came between the two halves of rank 0's, both ranks writing their final line at once)
_TAG = re.compile(r"\[\d+,(\d+)\]<(std(?:out|err))>:")


class Lines:
    """Reassembles each rank's lines from mpirun's tagged output: the newline that ends an output
    line ends the line of the rank whose chunk came last; the chunks before it on that output
    line are parts of their ranks' lines, continued by their next chunk."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}

    def feed(self, line: str) -> list[tuple[int | None, str]]:
        """The (rank, the rank's line) that one output line completes; (None, line) for
        mpirun's own."""
        tags = list(_TAG.finditer(line))
        if not tags:
            return [(None, line)]
        out: list[tuple[int | None, str]] = []
        if tags[0].start() > 0:
            out.append((None, line[: tags[0].start()]))
        for i, m in enumerate(tags):
            last = i + 1 == len(tags)
            key = (int(m.group(1)), m.group(2))
            text = (
                self._partial.pop(key, "")
                + line[m.end() : len(line) if last else tags[i + 1].start()]
            )
            if last:
                out.append((key[0], text))
            else:
                self._partial[key] = text
        return out


def untag(line: str) -> tuple[int | None, str]:
    """(rank, the rank's own line) of one output line that holds a whole line of one rank."""
    return Lines().feed(line)[-1]


def final_of(rank: int | None, text: str) -> events.Final | None:
    """The final event in one line of rank 0, or None."""
    event = events.parse_line(text) if rank == 0 else None
    return event if isinstance(event, events.Final) else None


def rank0_final(line: str) -> events.Final | None:
    return final_of(*untag(line))


def shown_of(rank: int | None, text: str) -> str | None:
    """What the launcher's log shows of one rank's line (None: nothing)."""
    if rank is None or rank == 0:
        return text
    return None if events.parse_line(text) is not None else f"[rank {rank}] {text}"


def shown(line: str) -> str | None:
    return shown_of(*untag(line))


#: mpirun's words when no rank could start: a command no retry can fix
_CANNOT_START = "unable to launch the specified application"


def cannot_start(own: list[str]) -> str | None:
    """From mpirun's own output lines: why it could not start a rank, or None."""
    text = " ".join(line.strip() for line in own if line.strip() and not line.startswith("---"))
    if _CANNOT_START not in text:
        return None
    return "mpirun could not start the job's ranks: " + text[text.index("mpirun") :][:500]


def main(argv: list[str], termination_log: str | None = options.TERMINATION_LOG) -> int:
    if argv[:1] == ["--no-termination-log"]:
        argv, termination_log = argv[1:], None
    if not argv or Path(argv[0]).name != "mpirun":
        print(
            "usage: python3 -m ringtrain_operator.mpilaunch [--no-termination-log] mpirun ARGS...",
            file=sys.stderr,
        )
        return 2
    final = None
    with subprocess.Popen(
        [argv[0], "--tag-output", *argv[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # mpirun's own errors too: they say whether to retry
        text=True,
        errors="replace",  # a rank's stray byte is shown as U+FFFD, never a traceback
        bufsize=1,
    ) as proc:
        previous = {
            sig: signal.signal(sig, lambda s, _f: proc.send_signal(s))
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            assert proc.stdout is not None
            lines, own = Lines(), list[str]()
            for line in proc.stdout:
                for rank, text in lines.feed(line.rstrip("\n")):
                    if (out := shown_of(rank, text)) is not None:
                        print(out, flush=True)
                    final = final_of(rank, text) or final
                    if rank is None:
                        own = [*own[-40:], text]
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    why = cannot_start(own) if code != 0 and final is None else None
    message = final.to_json() if final is not None else why
    if message is not None and termination_log is not None:
        try:
            Path(termination_log).write_text(message + "\n")
        except OSError as e:
            print(f"mpilaunch: cannot write {termination_log}: {e}", file=sys.stderr)
    if why is not None:
        print(f"mpilaunch: {why} (permanent: exit {EXIT_PERMANENT})", file=sys.stderr)
        return EXIT_PERMANENT
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
