"""Where a graph can be cut in two with one tensor between the halves; pure.

Recomputation keeps one checkpoint tensor per cut and pipelining passes one tensor over each
inter-IPU link, so both cut the graph only where its topological order has exactly one tensor
crossing: a chain (Keras ``Sequential``) anywhere, a residual model between its blocks. A
position ``k`` cuts between ``order[k - 1]`` and ``order[k]``.
"""

from __future__ import annotations

from ringtrain_trainer.engine.graph import Graph


def single_tensor_cuts(graph: Graph) -> dict[int, int]:
    """Position ``k`` (1 .. n-1) → the one tensor written before it and read after it, for
    every position where that tensor is the only one crossing, every reader of it is after the
    cut, and no graph input is read after it."""
    order, out = graph.order, {}
    pos = {i: k for k, i in enumerate(order)}
    last_read = {
        t: max((pos[c] for c in graph.consumers.get(t, ())), default=-1)
        for t in (*graph.inputs, *graph.producer)
    }
    born = {t: pos[graph.producer[t]] for t in graph.producer}
    for t in graph.inputs:
        born[t] = -1
    first_read = {
        t: min((pos[c] for c in graph.consumers.get(t, ())), default=-1) for t in last_read
    }
    for k in range(1, len(order)):
        crossing = [t for t, b in born.items() if b < k <= last_read[t]]
        # read only after the cut: its gradient is then complete when it crosses back
        if len(crossing) == 1 and crossing[0] not in graph.inputs and first_read[crossing[0]] >= k:
            out[k] = crossing[0]
    return out
