"""The compile plan's parameter side: the flat layout and the streaming piece grid; pure.

Layout: every parameter lives in one flat buffer in **reverse backward order** — the node whose
backward runs first comes first, and within a node its parameters in reverse (bias before
kernel) — as PyTorch DDP orders its buckets. Backward then finishes gradients front to back, so
every group of finished gradients is a contiguous slice that the reducer hands to the allreduce
without copying.

Piece grid: a parameter's gradient is computed and streamed in row blocks of at most
:data:`GRAD_BLOCK_ELEMS` elements (whole rows of its matrix view, blocks about equal), so the
host reduces the first rows of a large kernel while the rest is computed. The grid is a pure
function of the sizes and this one constant — no op decides it — and the reducer cuts its
buckets on the same grid, so a bucket always ends where a streamed piece ends.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ringtrain_trainer.engine.tensor import ParamSpec, Slot

#: weight gradients larger than this (elements) are computed and streamed in row blocks; the
#: reducer's buckets are cut on the same grid (``ModelSpec.param_pieces``). 64 Ki elements
#: (256 KiB in float32) keeps the seeds' 346,112-element Dense kernel in 6 blocks, enough for the
#: ring to start on the first while the others are computed.
GRAD_BLOCK_ELEMS = 1 << 16


def block_elems_for(world: int) -> int:
    """The grid a run streams on. Row blocks exist so the ring reduces a large kernel's first
    rows while the rest is computed; a lone worker has no ring to overlap, and every block is
    one more weight-gradient GEMM and one more point where the IPU's shards meet, so it streams
    one piece per parameter (the seeds' CNN step 2.69 -> 2.51 ms; the same bits: a row block
    is the same dot products, the optimizer elementwise)."""
    return GRAD_BLOCK_ELEMS if world > 1 else sys.maxsize


@dataclass(frozen=True)
class Piece:
    """One streamed gradient piece: rows ``rows`` of node ``node``'s parameter ``name``, at
    ``(start, stop)`` of the flat buffer."""

    node: int
    name: str
    rows: tuple[int, int]
    start: int
    stop: int

    @property
    def range(self) -> tuple[int, int]:
        return self.start, self.stop


def layout(backward: list[int], params: list[list[ParamSpec]]) -> tuple[list[Slot], int]:
    """Slots in reverse backward order (``backward``: the node indices in backward order;
    ``params[i]``: node ``i``'s parameters in its own order), and the total size."""
    slots, offset = [], 0
    for i in backward:
        for p in reversed(params[i]):
            slots.append(Slot(p, offset, offset + p.size))
            offset += p.size
    return slots, offset


def row_blocks(spec: ParamSpec, block_elems: int = GRAD_BLOCK_ELEMS) -> list[tuple[int, int]]:
    """About equal blocks of whole rows, each at most ``block_elems`` elements (a single row
    larger than that stays whole)."""
    rows = spec.rows
    blocks = max(1, -(-spec.size // block_elems))
    per = -(-rows // min(blocks, rows))
    return [(lo, min(lo + per, rows)) for lo in range(0, rows, per)]


def piece_grid(slots: list[Slot], block_elems: int = GRAD_BLOCK_ELEMS) -> list[Piece]:
    """Every streamed piece in the order backward writes them: the layout's order, each
    parameter in row blocks. Contiguous, from 0 to the end of the flat buffer."""
    out = []
    for s in slots:
        row = s.spec.size // s.spec.rows
        for lo, hi in row_blocks(s.spec, block_elems):
            start = s.start + lo * row
            out.append(Piece(s.spec.layer, s.spec.name, (lo, hi), start, s.start + hi * row))
    return out
