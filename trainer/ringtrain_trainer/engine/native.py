"""The engine's compiled kernels (``_native.c``), and what a worker says about them.

Why a C extension (issue 24): numpy cannot fuse a convolution with the pooling and activation
after it, so the seeds' first layer ran as ~20 memory-bound passes over a conv map four times
the size of its output (README, decisions: "A compiled kernel"). The extension is built by the
project's own install (``pyproject.toml``'s ``ext-modules``: ``hack/setup`` and the image), with
no dependency beyond a C compiler and Python's headers.

An op uses a kernel only where its arithmetic is the kernel's (float32, the shapes it takes) and
says so; everything else runs the numpy path. Without the extension (a source tree never
installed) every op runs numpy and :func:`describe` says why; the test suite asserts it is
built (``tests/trainer/test_native.py``), so CI never passes on the fallback by accident.
"""

from __future__ import annotations

from types import ModuleType

_loaded: ModuleType | None
try:
    import ringtrain_trainer.engine._native as _loaded
except ImportError as e:  # pragma: no cover - a tree installed without building
    _loaded, _why = None, str(e)
else:
    _why = ""

#: the compiled module, or None where it is not built
kernels: ModuleType | None = _loaded


def describe() -> str:
    """``native C (avx2)``, or why the numpy path runs."""
    if kernels is None:
        return f"numpy only (the C extension is not built: {_why}; run hack/setup)"
    return f"native C ({kernels.isa()})"
