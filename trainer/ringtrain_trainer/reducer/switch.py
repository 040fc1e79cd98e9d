"""The process-wide GIL switch interval, lowered while any communication thread runs.

CPython hands the GIL to a waiting thread only when the holder blocks or after the switch
interval (5 ms). The compute thread does release it inside every numpy call, but a woken
communication thread that has to wait for a CPU usually finds it taken again and then waits
the whole interval: measured, a bucket's allreduce often started only when backward ended.
The setting is global, so nested and concurrent users are counted and the first user's value
is restored after the last one leaves.
"""

from __future__ import annotations

import sys
import threading

#: GIL switch interval while a communication thread runs (CPython's default is 5 ms)
COMM_SWITCH_INTERVAL_S = 0.0005

_lock = threading.Lock()
_users = 0
_saved = 0.0


class lowered_switch_interval:
    """Context manager: ``sys.getswitchinterval()`` at most ``COMM_SWITCH_INTERVAL_S`` inside."""

    def __enter__(self) -> lowered_switch_interval:
        global _users, _saved
        with _lock:
            if _users == 0:
                _saved = sys.getswitchinterval()
                sys.setswitchinterval(min(_saved, COMM_SWITCH_INTERVAL_S))
            _users += 1
        return self

    def __exit__(self, *exc) -> None:
        global _users
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_saved)
