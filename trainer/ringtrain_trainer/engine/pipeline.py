"""Pipeline stages (Graphcore's ``PipelineStage``): where a model is cut over several IPUs and
what each stage's IPU holds; pure.

A stage is a run of the graph's topological order; stages meet at single-tensor cuts
(:mod:`.cuts`), so exactly one activation crosses each inter-IPU link forward and its gradient
backward. Stages are named by the user (the Keras layers that begin stages 2, 3, ...) or chosen
here from the compile-time memory plan: the cuts that minimise the largest stage.

A stage's plan (:func:`stage_plan`) is one IPU's: its layers' weights, gradients (the
micro-batch gradients are summed into them: the accumulator) and optimizer state; the
activations and workspace of every micro-batch in flight (the Grouped and Sequential
schedules run all forwards before the backwards, so ``depth`` micro-batches' saved tensors —
im2col columns, masks — are live, as the plan counts every workspace live); the link
buffers (``depth`` received activations and gradients); the input batches on the first stage
and the loss on the last.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from ringtrain import optionrules
from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer.engine.cuts import single_tensor_cuts
from ringtrain_trainer.engine.program import tensor_shapes

#: the rows of a stage's report that belong to no layer
LINK_IN_ROW, LINK_OUT_ROW = "(link in)", "(link out)"


@dataclass(frozen=True)
class Stage:
    """One stage: its nodes in forward order, the tensor it receives (None: the data) and the
    one it sends (None: the logits, to the loss)."""

    index: int
    nodes: tuple[int, ...]
    receives: int | None
    sends: int | None

    def describe(self, spec) -> str:
        first, last = spec.layers[self.nodes[0]].name, spec.layers[self.nodes[-1]].name
        return f"stage {self.index + 1} (layers {first!r}..{last!r})"


def _node_cost(base, i: int, depth: int) -> int:
    r = base.by_layer[i]
    return r.weights + r.gradients + r.optimizer_state + depth * (r.activations + r.workspace)


def split(spec, base, n_stages: int, depth: int, names: tuple[str, ...] = ()) -> list[Stage]:
    """The stages: at the named layers, or automatically (the fewest bytes on the fullest
    IPU). ``base``: the unpipelined plan of one micro-batch."""
    graph = spec.graph
    cuts = single_tensor_cuts(graph)
    order, n = graph.order, len(graph.order)
    if names:
        if (why := optionrules.stages_error(",".join(names), n_stages)) is not None:
            raise InvalidSpec(f"pipeline.stages {why}")
        pos = {spec.layers[i].name: k for k, i in enumerate(order)}
        chosen = []
        for name in names:
            k = pos.get(name)
            if k is None:
                raise InvalidSpec(f"pipeline.stages: no layer named {name!r}")
            if k not in cuts:
                raise InvalidSpec(
                    f"pipeline.stages: a stage cannot begin at layer {name!r}: more than one "
                    "tensor (or the input) passes from the layers before it to the ones after"
                )
            chosen.append(k)
        if sorted(chosen) != chosen or len(set(chosen)) != len(chosen):
            raise InvalidSpec("pipeline.stages: name the layers in model order, each once")
    else:
        if len(cuts) < n_stages - 1:
            raise InvalidSpec(
                f"pipeline.stages auto: the model has {len(cuts)} places where one tensor "
                f"passes between its layers, too few for {n_stages} stages (ipusPerWorker)"
            )
        chosen = _balanced([_node_cost(base, i, depth) for i in order], sorted(cuts), n_stages)
    bounds = [0, *chosen, n]
    stages = [
        Stage(
            s,
            tuple(order[a:b]),
            cuts[a] if a else None,
            cuts[b] if b < n else None,
        )
        for s, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    at = {i: st.index for st in stages for i in st.nodes}
    for tied, owner in spec.ties.items():  # one set of weights, one IPU
        if at[tied] != at[owner]:
            raise InvalidSpec(
                f"pipeline.stages: the shared layer {spec.layers[owner].name!r} is called in "
                f"stages {at[owner]} and {at[tied]} (supported: every call of a shared layer "
                "in one stage)"
            )
    return stages


def _balanced(costs: list[int], valid: list[int], stages: int) -> list[int]:
    """``stages - 1`` cut positions from ``valid`` minimising the largest stage's cost."""
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = [*valid, len(costs)]
    inf = float("inf")
    # best[j][e]: (largest stage, cuts) covering positions 0..e with j + 1 stages
    best: list[dict[int, tuple[float, list[int]]]] = [{e: (prefix[e], []) for e in ends}]
    for _ in range(1, stages):
        layer: dict[int, tuple[float, list[int]]] = {}
        for e in ends:
            cand: tuple[float, list[int]] = (inf, [])
            for c in valid:
                if c >= e or c not in best[-1]:
                    continue
                worst = max(best[-1][c][0], prefix[e] - prefix[c])
                if worst < cand[0]:
                    cand = (worst, [*best[-1][c][1], c])
            if cand[0] < inf:
                layer[e] = cand
        best.append(layer)
    return best[-1][len(costs)][1]


def stage_plan(spec, base, stage: Stage, depth: int, itemsize: int, batch: int, train: bool):
    """One stage's IPU: see the module docstring. ``base``: the unpipelined plan of one
    micro-batch of ``batch`` examples; its kinds add up like any plan's."""
    shapes = tensor_shapes(spec)
    k = depth if train else 1
    rows = [
        replace(
            base.by_layer[i],
            activations=k * base.by_layer[i].activations,
            workspace=k * base.by_layer[i].workspace,
        )
        for i in stage.nodes
    ]
    row = type(base.by_layer[0])
    if stage.receives is None:
        rows.append(replace(base.by_layer[-2], data=k * base.by_layer[-2].data))
    else:
        n = batch * math.prod(shapes[stage.receives]) * itemsize
        rows.append(row(LINK_IN_ROW, data=k * n, workspace=0))
    if stage.sends is None:
        rows.append(base.by_layer[-1])
    elif train:
        n = batch * math.prod(shapes[stage.sends]) * itemsize
        rows.append(row(LINK_OUT_ROW, workspace=k * n))  # the gradients coming back
    sums = {kind: sum(getattr(r, kind) for r in rows) for kind in base.kinds()}
    named = [(r.name, r.total) for r in rows[: len(stage.nodes)]]
    return replace(
        base, **sums, layers=tuple(sorted(named, key=lambda nb: -nb[1])), by_layer=tuple(rows)
    )


def check_fits(spec, stages: list[Stage], plans: list, auto: bool) -> None:
    """Refuse a split whose fullest stage does not fit its IPU, naming that stage."""
    worst = max(range(len(plans)), key=lambda s: plans[s].total)
    p = plans[worst]
    if p.total <= p.capacity:
        return
    how = (
        f"fits no split into {len(stages)} stages"
        if auto
        else f"does not fit the {len(stages)} stages named by pipeline.stages"
    )
    raise IPUCompileError(
        f"model {spec.name!r} {how}: the largest stage, {stages[worst].describe(spec)}: "
        f"{p.describe()} (raise --ipus-per-worker or --ipu-memory-mb, or lower --batch-size)"
    )
