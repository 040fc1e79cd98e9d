"""ring.malloc_tuning: glibc takes the settings, memory under 32 MiB then stays in the heap
(neither mmapped nor trimmed), and the user's own malloc environment or a non-glibc platform
leave malloc alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ringtrain_trainer.ring import malloc_tuning

needs_glibc = pytest.mark.skipif(malloc_tuning.glibc() is None, reason="Linux with glibc only")

#: A fresh process allocates 8 MiB, then frees it, and reports what glibc's mallinfo2 saw.
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from ringtrain_trainer.ring import malloc_tuning

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    tuned = malloc_tuning.tune() if sys.argv[1] == "tune" else None
    before = libc.mallinfo2()
    p = libc.malloc(8 << 20)
    ctypes.memset(p, 1, 8 << 20)
    live = libc.mallinfo2()
    libc.free(p)
    after = libc.mallinfo2()
    print(json.dumps({"tuned": tuned, "mmapped_while_live": live.hblkhd - before.hblkhd,
                      "free_kept_after": after.fordblks}))
""")


def _probe(arg: str, env: dict | None = None) -> dict:
    import json

    env = dict(os.environ if env is None else env)
    for k in malloc_tuning.USER_ENV:
        env.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, arg],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return json.loads(out)


@needs_glibc
def test_tuned_process_keeps_an_8_mib_buffer_in_its_heap():
    plain, tuned = _probe("plain"), _probe("tune")
    assert plain["mmapped_while_live"] >= 8 << 20  # glibc's default: its own mmap
    assert tuned["tuned"] is True
    assert tuned["mmapped_while_live"] == 0  # from the heap instead
    assert tuned["free_kept_after"] >= 8 << 20  # and not trimmed once freed


@needs_glibc
def test_the_users_malloc_environment_wins():
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert _probe("tune", env)["tuned"] is False
    assert malloc_tuning.user_chose({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert malloc_tuning.user_chose({"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"})
    assert not malloc_tuning.user_chose({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"})


def test_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert malloc_tuning.glibc() is None
    assert malloc_tuning.tune() is False
