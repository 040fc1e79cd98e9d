"""The MPI launcher pod's main process: ``mpirun``, with rank 0's result as the pod's result.

``python3 -m ringtrain_operator.mpilaunch mpirun ...`` runs mpirun with ``--tag-output`` (each
line of a rank prefixed ``[job,rank]<stdout>:``), passes every line on to the pod's log, and
keeps rank 0's last final event. Rank 0 runs in worker 0, whose container (sshd) never ends,
so its own termination log is never read; the operator reads the launcher's instead, as it
reads a ring chief's. The exit status is mpirun's; SIGTERM and SIGINT are passed on to it.
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


def rank0_final(line: str) -> events.Final | None:
    """The final event in one tagged line of rank 0, or None."""
    m = _TAG.match(line)
    if not m or m.group(1) != "0":
        return None
    event = events.parse_line(m.group(2))
    return event if isinstance(event, events.Final) else None


def main(argv: list[str], termination_log: str = options.TERMINATION_LOG) -> int:
    if not argv or Path(argv[0]).name != "mpirun":
        print("usage: python3 -m ringtrain_operator.mpilaunch mpirun ARGS...", file=sys.stderr)
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
                sys.stdout.write(line)
                final = rank0_final(line.rstrip("\n")) or final
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if final is not None:
        try:
            Path(termination_log).write_text(final.to_json() + "\n")
        except OSError as e:
            print(f"mpilaunch: cannot write {termination_log}: {e}", file=sys.stderr)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
