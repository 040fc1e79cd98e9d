"""The engine's compiled kernels (``_native.c``), and what a worker says about them.

Why a C extension (issue 24): numpy cannot fuse a convolution with the pooling and activation
after it, so the seeds' first layer ran as ~20 memory-bound passes over a conv map four times
the size of its output (README, decisions: "A compiled kernel"). The extension is built by the
project's own install (``setup.py``'s ``ext_modules``: ``hack/setup`` and the image), with
no dependency beyond a C compiler and Python's headers.

The kernels (``kernels.h``, ``gemm.h``, ``depthwise.h``) are compiled once per instruction set
(AVX-512, AVX2 with FMA, the x86-64 baseline) and the widest this CPU has runs; every set gives
the same bits. ``RINGTRAIN_KERNELS`` forces a narrower set this CPU also has (:func:`force`,
applied once by the process's edge: the worker's config, ``ringtrain bench step``), so one
AVX-512 machine measures and tests what an AVX2-only one runs (issue 39, decision 0218). The
GEMM runs a layer's product only where it beat OpenBLAS when measured: a Dense's on AVX-512
(``GEMM_SETS``), a convolution's, which it reads in place with no im2col matrix, on AVX2 too
(``CONV_GEMM_SETS``); elsewhere BLAS does. An op uses a kernel only where its arithmetic is
the kernel's (float32, the shapes it takes) and says so (``startup.kernels_line``); everything
else runs the numpy path. Without the extension (a source tree never
installed) every op runs numpy and :func:`describe` says why; the test suite asserts it is
built (``tests/trainer/test_native.py``), so CI never passes on the fallback by accident.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import ModuleType

import numpy as np

from ringtrain.errors import InvalidSpec

_loaded: ModuleType | None
try:
    import ringtrain_trainer.engine._native as _loaded
except ImportError as e:  # pragma: no cover - a tree installed without building
    _loaded, _why = None, str(e)
else:
    _why = ""

#: the environment variable that forces a kernel set (:func:`force`)
ENV = "RINGTRAIN_KERNELS"
#: the kernel sets, widest first; a CPU runs the first it has and can run every one after it
SETS = ("avx512", "avx2", "baseline")
#: the set chosen at import (the widest this CPU has), before anything forced another
WIDEST = _loaded.isa() if _loaded is not None else None
_forced = False

#: the compiled module, or None where it is not built
kernels: ModuleType | None = _loaded


def loaded() -> ModuleType:
    """The compiled module, where the caller decided it runs (an op's ``ws["native"]`` or
    ``ws["gemm"]``, set at ``bind`` from :func:`gemm_runs` and ``kernels is not None``)."""
    assert kernels is not None, "a compiled kernel was chosen but the extension is not built"
    return kernels


def describe() -> str:
    """``native C (avx512)`` (the set that runs; where :func:`force` chose it, the variable and
    the widest this CPU has), or why the numpy path runs."""
    if kernels is None:
        return f"numpy only (the C extension is not built: {_why}; run hack/setup)"
    if _forced:
        return f"native C ({kernels.isa()}, forced by {ENV}; this CPU has {WIDEST})"
    return f"native C ({kernels.isa()})"


def available() -> tuple[str, ...]:
    """The kernel sets this CPU can run, widest first (none without the extension)."""
    return SETS[SETS.index(WIDEST) :] if kernels is not None and WIDEST is not None else ()


def chosen(name: str) -> str:
    """``name`` (the value of ``RINGTRAIN_KERNELS``) as a kernel set this CPU runs, "" for
    none; a set this CPU lacks (its instructions would kill the process) or an unknown name
    is refused, naming the variable and the sets."""
    name = name.strip().lower()
    have = available()
    if name and name not in have:
        why = (
            "the C extension is not built"
            if kernels is None
            else f"this CPU runs {', '.join(have)}"
            if name in SETS
            else f"the sets are {', '.join(SETS)}; this CPU runs {', '.join(have)}"
        )
        raise InvalidSpec(f"{ENV}={name}: not a kernel set this CPU can run ({why})")
    return name


def force(name: str) -> None:
    """Run the kernel set ``name`` from now on, in this process; "" changes nothing. Why a
    switch at all: each set gives the same bits but not the same speed, and the GEMM runs only
    on the sets in ``GEMM_SETS`` and ``CONV_GEMM_SETS``, so an AVX-512 machine must run what an
    AVX2 one does to measure it. Call before compiling a model: an op chooses its kernel at
    ``bind``."""
    global _forced
    name = chosen(name)
    if name:
        loaded().use(name)
        _forced = name != WIDEST


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    """Denormals flushed to zero on this thread for the block (FTZ and DAZ), as TensorFlow runs
    every CPU kernel (its ScopedFlushDenormal) and so every Keras optimizer: a moment whose
    gradient stays zero decays into denormals within hundreds of steps, where IEEE arithmetic
    keeps them (slowly: each costs a microcode assist) and TensorFlow has zeros. Without the C
    extension, IEEE arithmetic."""
    if kernels is None:
        yield
        return
    was = kernels.flush_denormals(True)
    try:
        yield
    finally:
        kernels.flush_denormals(was)


#: the kernel sets whose GEMM (``gemm.h``) beats OpenBLAS on the engine's narrow products,
#: measured per set (decisions 0015, 0218); elsewhere BLAS runs them
GEMM_SETS = ("avx512",)
#: the sets whose GEMM beats im2col + BLAS on a convolution: reading the input in place saves
#: writing and reading back a matrix k times the input, which outweighs AVX2's slower product
#: (1.2-3.2x per conv of the zoo's shapes, even at 13x13x32 -> 64; a Dense's product alone
#: is 0.6-0.9x BLAS's there: decision 0218)
CONV_GEMM_SETS = ("avx512", "avx2")
#: the widest output the GEMM takes for a layer: its whole row of C stays in registers
GEMM_MAX_WIDTH = 64


def gemm_runs(width: int, dtype: np.dtype, conv: bool = False) -> bool:
    """Whether a float32 product ``(M x K) @ (K x width)`` runs the compiled GEMM here;
    ``conv``: a convolution's, its input read in place (:data:`CONV_GEMM_SETS`)."""
    return (
        kernels is not None
        and kernels.isa() in (CONV_GEMM_SETS if conv else GEMM_SETS)
        and 0 < width <= GEMM_MAX_WIDTH
        and np.dtype(dtype) == np.float32
    )


def offsets(*axes: tuple[int, int]) -> np.ndarray:
    """The int32 offset table of a grid: ``axes`` are (count, stride) pairs, first slowest;
    ``offsets((m, lda))`` are a matrix's row starts, ``offsets((k, 1))`` its columns."""
    table = np.zeros((), np.int64)
    for n, stride in axes:
        table = table[..., None] + stride * np.arange(n, dtype=np.int64)
    return np.ascontiguousarray(table.reshape(-1), dtype=np.int32)


def finite(a: np.ndarray) -> bool:
    """Whether every element of ``a`` is finite, allocating nothing: the compiled exponent
    test for a float32 slice (25 µs for the cnn's 347k gradients), else a
    float32 sum (SIMD; 120 µs, errstate included), confirmed in float64 only when it is not
    finite, where a sum of finite float32 values cannot overflow (the exact test)."""
    k = kernels
    if k is not None and a.dtype == np.float32 and a.flags.c_contiguous:
        return k.all_finite(a)
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf, an overflow: answers here
        return math.isfinite(np.add.reduce(a)) or math.isfinite(np.add.reduce(a, dtype=np.float64))
