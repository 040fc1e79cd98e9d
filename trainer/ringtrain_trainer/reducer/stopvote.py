"""The stop vote: one control element that rides in the last gradient bucket.

Each worker writes 1 there when it was asked to stop (SIGTERM) and 0 otherwise; the element
is reduced with the gradients, so after a step's allreduce every worker reads the same mean
and all stop after the same step, nobody left waiting in a collective, at no extra collective
per step. It sits right after the parameters' gradients, so the optimizer never sees it.
"""

from __future__ import annotations

import numpy as np


class StopVote:
    """Owns element ``index`` of the reducer's flat buffer (the one after the gradients)."""

    #: elements the vote adds to the reduced buffer
    ELEMS = 1

    def __init__(self, buffer: np.ndarray, index: int):
        if not 0 <= index < buffer.size:
            raise ValueError(f"stop vote at {index} outside a buffer of {buffer.size}")
        self._buffer, self.index = buffer, index

    @property
    def piece(self) -> tuple[int, int]:
        """The vote's ``(start, stop)`` in the buffer: a streamed piece of its own."""
        return self.index, self.index + 1

    def cast(self, stop: bool) -> None:
        self._buffer[self.index] = 1.0 if stop else 0.0

    def agreed(self) -> bool:
        """After the step's reduction: did any worker vote to stop?"""
        return bool(self._buffer[self.index] > 0)
