"""glibc malloc settings for a ring process: per-chunk buffers reuse memory already faulted in.

Why: every chunk of an allreduce makes short-lived buffers of about a chunk's size (1 MiB by
default): on the ``grpc`` data path grpcio's slices and the fresh ``bytes`` of each received
message, on ``grpc+tcp`` fewer. glibc serves anything over ``M_MMAP_THRESHOLD`` (128 KiB at
start; raised on the fly by some frees) with its own ``mmap`` and ``munmap``, and gives the
free top of a heap back to the kernel past ``M_TRIM_THRESHOLD`` (in the arena of grpcio's
threads: ``madvise`` to shrink, ``mprotect`` to grow again); either way the next buffer lands
on fresh pages and pays a page fault per 4 KiB. Raising the mmap threshold to 32 MiB, trimming
never (1 GiB) and growing heaps 64 MiB at a time (``M_TOP_PAD``) keeps those pages in the
process, so a chunk's buffer reuses memory that is already mapped.

Measured (``ringtrain bench allreduce --workers 2 --size-mib 1 64 --transport grpc
--baseline gloo``, 2 shared cores, load 1–7, interleaved runs; docs/ring.md "What limits each
path" has them): without it the ``grpc`` path's CPU per 64 MiB allreduce is bimodal, 121–137 ms
or 71–87 ms, set by incidental allocation order (the same code with one more small module
imported flips it); the slow mode spends 238,000 minor page faults and 4,566 ``mprotect`` /
247 ``madvise`` calls per 13 allreduces growing and shrinking a thread arena's heap around
every message, against ~28,000 faults and ~89 / ~75 calls in the fast one. With the settings
every run was in the fast mode: 74–89 ms CPU (1 MiB: 2.5–3.3 ms against 4.0–4.9 ms in the slow
mode), busbw against gloo's plain sum 0.29–0.51× (slow mode) → 0.45–0.69×. ``grpc+tcp``
allocates little per chunk and shows no change. Any one setting alone is worse than none:
setting one turns off glibc's dynamic threshold, so the mmap threshold alone still trims
(162 ms) and the trim threshold alone mmaps every chunk (226 ms).

The price: memory freed below 32 MiB stays with the process instead of going back to the
kernel, so its resident size stays at the peak it reached (never above it; heap padding is
reserved, not touched). A process started with glibc's own ``MALLOC_*_`` variables or malloc
tunables keeps those (the user's choice wins). Elsewhere than Linux with glibc (musl, macOS)
this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: mallopt's parameter numbers (glibc's <malloc.h>).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3

#: What :func:`tune` sets, in this order.
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

#: Environment that means the user already chose malloc's settings for this process.
USER_ENV = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # no such name: not glibc
        return None
    return ctypes.CDLL(None)


def user_chose(env: dict | os._Environ = os.environ) -> bool:
    """True when glibc was told how to allocate from the environment."""
    return any(env.get(k) for k in USER_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def tune(env: dict | os._Environ = os.environ) -> bool:
    """Apply :data:`SETTINGS` once, at the start of a ring process. True when glibc took them
    all; False (and nothing changed) off glibc or when :func:`user_chose`."""
    libc = glibc()
    if libc is None or user_chose(env):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
