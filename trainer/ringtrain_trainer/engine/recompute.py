"""Recomputation (Graphcore's ``allow_recompute``, PopTorch's recomputation checkpoints): keep
only checkpoint tensors through forward and recompute the rest of each segment in backward.

The compile step cuts the graph at single-tensor cuts (:mod:`.cuts`) into segments. Forward
copies each cut tensor into its own checkpoint buffer; backward, before the nodes of a segment
other than the last, runs that segment's forward again from its checkpoint. On the IPU only
the checkpoints and one segment's activations and workspace are then live at a time, so the
plan (:func:`plan`) counts the checkpoints plus the largest segment instead of every layer:
a model that does not fit fits at the cost of one more forward of all but the last segment.

The emulator keeps every layer's host buffers (some hold compile-time constants: padding
borders, ones vectors), so the saving is the device plan's, while the recomputation itself
really runs: its time shows in the step and the trace. Moving statistics (BatchNormalization)
are restored after a recomputed forward, so they update once per step as without it.

Checkpoints are chosen by the user (``recomputation_checkpoints``: the layers whose outputs are
kept) or automatically: the cuts that minimise checkpoints + largest segment.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.cuts import single_tensor_cuts
from ringtrain_trainer.engine.program import Program, tensor_shapes

#: the row of the memory report that holds the checkpoint tensors
CHECKPOINT_ROW = "(recompute checkpoints)"


def _live(row) -> int:
    return row.activations + row.workspace


def choose(spec, base, batch: int, itemsize: int, names: tuple[str, ...] = ()) -> list[int]:
    """Cut positions (in ``spec.graph.order``): the named layers' outputs, or automatic."""
    graph = spec.graph
    cuts = single_tensor_cuts(graph)
    if names:
        pos = {spec.layers[i].name: k for k, i in enumerate(graph.order)}
        chosen = []
        for name in names:
            k = pos.get(name)
            if k is None:
                raise InvalidSpec(f"recomputationCheckpoints: no layer named {name!r}")
            if k + 1 not in cuts:
                raise InvalidSpec(
                    f"recomputationCheckpoints: layer {name!r}: its output is not the only tensor "
                    "between the layers before and after it, so it cannot be a checkpoint"
                )
            chosen.append(k + 1)
        return sorted(set(chosen))
    shapes = tensor_shapes(spec)
    ckpt = {k: batch * math.prod(shapes[t]) * itemsize for k, t in cuts.items()}
    live = [_live(base.by_layer[i]) for i in graph.order]
    prefix = [0]
    for v in live:
        prefix.append(prefix[-1] + v)
    n, valid = len(live), sorted(cuts)
    ends = [0, *valid, n]
    best: tuple[int, list[int]] = (prefix[n], [])
    for target in sorted({prefix[b] - prefix[a] for a in ends for b in ends if b > a}):
        chosen, start, prev = [], 0, 0
        for c in [*valid, n]:
            if prefix[c] - prefix[start] <= target:
                prev = c
                continue
            if prev == start:
                break
            chosen.append(prev)
            start = prev
            if prefix[c] - prefix[start] > target:
                break
            prev = c
        else:
            bounds = [0, *chosen, n]
            peak = max(prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds))
            cost = peak + sum(ckpt[k] for k in chosen)
            if cost < best[0]:
                best = (cost, chosen)
    return best[1]


def segments(spec, cut_positions: list[int]) -> list[list[int]]:
    """The node indices of each segment, in forward order."""
    order, bounds = spec.graph.order, [0, *cut_positions, len(spec.graph.order)]
    return [order[a:b] for a, b in itertools.pairwise(bounds)]


def plan(spec, base, batch: int, itemsize: int, cut_positions: list[int]):
    """The memory plan with recomputation: the layers of the largest segment keep their
    activations and workspace, the others' are recomputed (0 here); the checkpoints are one
    more row. Its kinds add up like any plan's."""
    if not cut_positions:
        return base
    cuts, shapes = single_tensor_cuts(spec.graph), tensor_shapes(spec)
    segs = segments(spec, cut_positions)
    peak = max(segs, key=lambda s: sum(_live(base.by_layer[i]) for i in s))
    keep = set(peak)
    rows = [
        r if i in keep or i >= len(spec.layers) else replace(r, activations=0, workspace=0)
        for i, r in enumerate(base.by_layer)
    ]
    ckpt = sum(batch * math.prod(shapes[cuts[k]]) * itemsize for k in cut_positions)
    # the forward's copy of each cut tensor and its gradient's
    rows.insert(len(spec.layers), type(base.by_layer[0])(CHECKPOINT_ROW, activations=2 * ckpt))
    sums = {k: sum(getattr(r, k) for r in rows) for k in base.kinds()}
    named = [(r.name, r.total) for r in rows[: len(spec.layers)]]
    return replace(
        base,
        **sums,
        layers=tuple(sorted(named, key=lambda nb: -nb[1])),
        by_layer=tuple(rows),
    )


class RecomputeProgram(Program):
    """A training :class:`Program` that recomputes each segment but the last in backward."""

    def __init__(
        self,
        spec,
        batch,
        train,
        dtype=np.float32,
        grads_first=False,
        state=None,
        *,
        cut_positions: list[int],
    ):
        super().__init__(spec, batch, train, dtype, grads_first, state)
        cuts, shapes = single_tensor_cuts(spec.graph), tensor_shapes(spec)
        self.segments = segments(spec, cut_positions)
        #: per segment but the last: the tensor kept at its end
        self.cut_tensors = [cuts[k] for k in cut_positions]
        self.ckpt = {t: np.zeros((batch, *shapes[t]), self.dtype) for t in self.cut_tensors}
        self.gckpt = {t: np.zeros((batch, *shapes[t]), self.dtype) for t in self.cut_tensors}
        self._state_backup = np.zeros_like(self.state)
        #: recomputed node forwards, counted (tests, the trace)
        self.recomputed = 0

    def forward(self, params, on_layer=None):
        if not self.train:
            return super().forward(params, on_layer)
        self.split_inputs()
        for s, seg in enumerate(self.segments):
            for i in seg:
                self.forward_node(i, params)
                if on_layer is not None:
                    on_layer(i)
            if s < len(self.cut_tensors):
                t = self.cut_tensors[s]
                np.copyto(self.ckpt[t], self.tensor(t))
                self.tensors[t] = self.ckpt[t]
        return self.pack_outputs()

    def backward_pieces(self, params, grads, on_layer=None):
        self.seed_output_grads()
        last = len(self.segments) - 1
        for s in range(last, -1, -1):
            seg = self.segments[s]
            if s < last:
                np.copyto(self._state_backup, self.state)
                for i in seg:
                    self.forward_node(i, params)
                self.recomputed += len(seg)
                np.copyto(self.state, self._state_backup)
                t = self.cut_tensors[s]
                self.tensors[t] = self.ckpt[t]
                self._grads[t] = self.gckpt[t]
            for i in reversed(seg):
                yield from self.backward_node(i, params, grads)
                if on_layer is not None:
                    on_layer(i)
            if s > 0:
                t = self.cut_tensors[s - 1]
                np.copyto(self.gckpt[t], self.tensor_grad(t).reshape(self.gckpt[t].shape))
