"""Mixed precision on the emulated IPU: float16 values computed with float32 arithmetic.

Why emulated: numpy's float16 matmul has no BLAS kernel. Measured on this project's machine
(one BLAS thread), the cnn's Dense (64x5408 @ 5408x64) takes 4.6 ms in float32 and 637 ms in
float16, its im2col conv matmul 2.0 ms vs 346 ms: 140-170x. So every op runs in float32 on
values that are float16 (weights, inputs, every node's output and every gradient are rounded to
float16 in place after they are written), which is what an IPU's float16 op with float32
partials computes: products of float16 values are exact in float32, the sum is accumulated in
float32 and the result is stored as float16. Rounding a tensor costs two casts (about 1 ms per
346k elements); ``ringtrain bench step`` reports the step time it costs.

Rounding is to nearest, or stochastic (Graphcore's ``stochastic_rounding``): the float32 bit
pattern gets a uniform random integer below 2**13 added to the 13 mantissa bits float16 drops,
which are then cleared, so a value rounds away from zero with probability equal to its distance
from the lower neighbour — unbiased. The result is cast to float16 exactly, except below
float16's normal range (|x| < 2**-14), where the cast rounds to nearest on the subnormal grid.
Values beyond 65504 become inf, as on the IPU: that is what dynamic loss scaling detects.

Where stochastic rounding applies (``STOCHASTIC_ROUNDING``): ``ON`` everywhere, each replica
with its own generator (its weights' float16 copy differs from its peers'); ``REPLICA_IDENTICAL
_ONLY`` only where every replica computes the same thing — the float16 copy of the float32
master weights, with a generator seeded alike on every worker, so replicas stay bit-identical;
activations and gradients then round to nearest. ``OFF`` rounds to nearest everywhere.
"""

from __future__ import annotations

import numpy as np

#: Graphcore's settings of ``stochastic_rounding`` (``ringtrain.options``' choices)
STOCHASTIC_ROUNDING = ("OFF", "ON", "REPLICA_IDENTICAL_ONLY")
#: the float32 mantissa bits float16 does not keep
_DROPPED = 13
_KEEP = np.uint32((0xFFFFFFFF >> _DROPPED) << _DROPPED)


class Rounder:
    """Rounds float32 arrays of up to ``capacity`` elements to float16 values, in place.

    ``seed`` None: to nearest; otherwise stochastically from a generator of that seed. Buffers
    are allocated once; calls allocate nothing (for contiguous arrays)."""

    def __init__(self, capacity: int, seed: int | tuple | None = None):
        self.half = np.zeros(capacity, np.float16)
        self.stochastic = seed is not None
        if self.stochastic:
            self.rng = np.random.default_rng(seed)
            self.uniform = np.zeros(capacity, np.float32)
            self.bits = np.zeros(capacity, np.uint32)

    def __call__(self, x: np.ndarray) -> None:
        if not x.flags.c_contiguous:  # never in a compiled program; kept correct regardless
            x[...] = x.astype(np.float16)
            return
        flat = x.reshape(-1)
        n = flat.size
        if n > self.half.size:
            raise ValueError(f"rounding {n} elements with a buffer of {self.half.size}")
        if self.stochastic:
            u, r = self.uniform[:n], self.bits[:n]
            self.rng.random(out=u, dtype=np.float32)
            np.multiply(u, np.float32(1 << _DROPPED), out=u)
            np.copyto(r, u, casting="unsafe")
            b = flat.view(np.uint32)
            np.add(b, r, out=b)
            np.bitwise_and(b, _KEEP, out=b)
        h = self.half[:n]
        with np.errstate(over="ignore"):
            np.copyto(h, flat, casting="same_kind")
        np.copyto(flat, h)


class Precision:
    """One IPU's numeric settings: ``fp16`` (with its loss scale and rounding) or ``fp32``."""

    def __init__(self, precision: str = "fp32", stochastic_rounding: str = "OFF"):
        if precision not in ("fp32", "fp16"):
            raise ValueError(f"precision must be fp32 or fp16, got {precision!r}")
        if stochastic_rounding not in STOCHASTIC_ROUNDING:
            raise ValueError(f"stochastic rounding must be one of {STOCHASTIC_ROUNDING}")
        self.half = precision == "fp16"
        self.name = precision
        self.stochastic_rounding = stochastic_rounding
        #: the loss scale this step's backward multiplies dloss/doutput by (the host's)
        self.loss_scale = 1.0

    @property
    def itemsize(self) -> int:
        """Bytes per value on the device: what the memory plan counts."""
        return 2 if self.half else 4

    def weight_rounder(self, size: int, seed: int, rank: int) -> Rounder | None:
        """For the float16 copy of the master weights: replica-identical unless ``ON``."""
        if not self.half:
            return None
        if self.stochastic_rounding == "OFF":
            return Rounder(size)
        return Rounder(size, (seed, 1, rank) if self.stochastic_rounding == "ON" else (seed, 1))

    def program_rounder(self, size: int, seed: int, rank: int, shard: int) -> Rounder | None:
        """For one program's activations and gradients: per replica when ``ON``."""
        if not self.half:
            return None
        sr = self.stochastic_rounding == "ON"
        return Rounder(size, (seed, 2, rank, shard) if sr else None)
