"""Keras' gradient clipping on the *reduced* gradient, and when each slice may be applied.

Keras clips in ``BaseOptimizer._clip_gradients`` (at most one of the three is set):

* ``clipvalue``: ``clip(g, -v, v)`` element by element, so every reduced slice is applied as
  soon as it arrives (the streaming apply is unchanged);
* ``clipnorm``: per *variable* (weight tensor), ``g * c / max(||g||, c)``; a tensor's norm
  needs all of it, and the reducer's buckets may cut a tensor in pieces, so a tensor is
  clipped and applied when its last reduced piece arrives (each tensor still updates while
  the rest of backward and communication runs);
* ``global_clipnorm``: ``g * c / max(||G||, c)`` over all gradients, known only once the whole
  gradient is reduced: the update is deferred to the last reduced slice and runs as one
  ``apply`` of the whole buffer. Its cost: the optimizer no longer overlaps backward and
  communication (README, "Decisions and known limits", has the measurement).

Clipping writes into the reducer's gradient buffer in place (it is rewritten by the next
backward), so nothing is allocated per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

KINDS = ("clipvalue", "clipnorm", "global_clipnorm")


class Clip:
    """One step's clipping state; ``tensors`` are the (start, stop) ranges of the flat buffer
    that are Keras variables (``ModelSpec.slots``), sorted by start."""

    def __init__(
        self,
        kind: str | None,
        value: float,
        tensors: Sequence[tuple[int, int]],
        whole: bool = False,
    ):
        """``whole``: yield only whole tensors, whatever the clipping (an optimizer whose update
        reads a whole tensor: ``adafactor``)."""
        if kind not in (None, *KINDS):
            raise ValueError(f"unknown clipping {kind!r}")
        self.kind, self.value, self.whole = kind, float(value), whole
        ranges = sorted((int(a), int(b)) for a, b in tensors)
        self.starts = np.array([a for a, _ in ranges], np.int64)
        self.stops = np.array([b for _, b in ranges], np.int64)
        self.size = int(self.stops[-1]) if ranges else 0
        self.covered = np.zeros(len(ranges), np.int64)
        self.total = 0

    def begin_step(self) -> None:
        self.covered[:] = 0
        self.total = 0

    def ready(self, grads: np.ndarray, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """Clip what ``grads[start:stop]`` completes, in place, and yield the ranges to apply."""
        if self.kind == "clipvalue":
            g = grads[start:stop]
            np.clip(g, -self.value, self.value, out=g)
        if self.kind in (None, "clipvalue") and not self.whole:
            yield start, stop
        elif self.kind in (None, "clipvalue", "clipnorm"):
            t = max(0, int(np.searchsorted(self.starts, start, "right")) - 1)
            while t < len(self.starts) and self.starts[t] < stop:
                a, b = int(self.starts[t]), int(self.stops[t])
                self.covered[t] += max(0, min(b, stop) - max(a, start))
                if self.covered[t] == b - a:
                    g = grads[a:b]
                    norm = math.sqrt(float(np.dot(g, g))) if self.kind == "clipnorm" else 0.0
                    if norm > self.value:
                        np.multiply(g, np.float32(self.value / norm), out=g)
                    yield a, b
                t += 1
        else:  # global_clipnorm
            self.total += stop - start
            if self.total >= self.size:
                g = grads[: self.size]
                norm = math.sqrt(float(np.dot(g, g)))
                if norm > self.value:
                    np.multiply(g, np.float32(self.value / norm), out=g)
                if self.whole:  # Lamb's trust ratio, Adafactor's moments: tensor by tensor
                    yield from zip(self.starts.tolist(), self.stops.tolist(), strict=True)
                else:
                    yield 0, self.size
