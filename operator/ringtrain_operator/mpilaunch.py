"""The MPI launcher pod's main process: ``mpirun``, with rank 0's result as the pod's result.

``python3 -m ringtrain_operator.mpilaunch [--no-termination-log] mpirun ...`` runs mpirun with
``--tag-output`` (each line of a rank prefixed ``[job,rank]<stdout>:``) and passes its output on
as the chief's would read: rank 0's lines as they are, the other ranks' log lines prefixed with
their rank and their event lines dropped (rank 0's are the job's; two ranks' ``final`` lines
would contradict each other). It keeps rank 0's last final event: rank 0 runs in worker 0,
whose container (sshd) never ends, so its own termination log is never read; the launcher's
is, as a ring chief's is (``ringtrain run`` reads rank 0's own file: --no-termination-log).
The exit status is mpirun's; SIGTERM and SIGINT are passed on to it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from ringtrain import events, options

#: Open MPI's --tag-output prefix: [jobid,rank]<stream>:
_TAG = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:(.*)$")
#: the same prefix inside a line: Open MPI tags every chunk a rank writes, so a line written in
#: two chunks (its newline apart, under load) reads ``[1,0]<stdout>:{...}[1,0]<stdout>:``
_INNER_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


def untag(line: str) -> tuple[int | None, str]:
    """(rank, the rank's own line) of one tagged line; (None, line) for mpirun's own."""
    m = _TAG.match(line)
    return (int(m.group(1)), _INNER_TAG.sub("", m.group(2))) if m else (None, line)


def rank0_final(line: str) -> events.Final | None:
    """The final event in one tagged line of rank 0, or None."""
    rank, text = untag(line)
    event = events.parse_line(text) if rank == 0 else None
    return event if isinstance(event, events.Final) else None


def shown(line: str) -> str | None:
    """What the launcher's log shows of one tagged line (None: nothing)."""
    rank, text = untag(line)
    if rank is None or rank == 0:
        return text
    return None if events.parse_line(text) is not None else f"[rank {rank}] {text}"


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
        [argv[0], "--tag-output", *argv[1:]], stdout=subprocess.PIPE, text=True, bufsize=1
    ) as proc:
        previous = {
            sig: signal.signal(sig, lambda s, _f: proc.send_signal(s))
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if (text := shown(line)) is not None:
                    print(text, flush=True)
                final = rank0_final(line) or final
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if final is not None and termination_log is not None:
        try:
            Path(termination_log).write_text(final.to_json() + "\n")
        except OSError as e:
            print(f"mpilaunch: cannot write {termination_log}: {e}", file=sys.stderr)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
