"""The IPU memory report (PopVision's memory report, in small): what one IPU holds, by kind and
by layer, from the compile-time plan.

Pipeline position: :class:`.device.IPU` calls :func:`plan_memory` when it compiles
a program and refuses one that does not fit; the worker hands the training program's plan to
the metrics (``ringtrain_ipu_memory_bytes{kind}``), to ``/status`` (:func:`status_doc`) and,
for ``ringtrain worker --report``, to :func:`format_report`. One function computes the plan, so
the out-of-memory error, the metrics and the report cannot disagree.

Where the optimizer state lives follows ``variables_on_host``: on the host (the default, as the
seeds run) the IPU holds none of it and :func:`host_optimizer_state` counts it; resident, each
layer's slots (momentum 1, Adam 2, plain SGD 0 per parameter) count against the IPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ringtrain_trainer.engine import workspace
from ringtrain_trainer.engine.multiloss import loss_bytes
from ringtrain_trainer.engine.program import accumulators

#: the kinds of device memory, in the order the report, the metric and the panel use
KINDS = ("weights", "gradients", "activations", "workspace", "data", "optimizer_state")
#: rows of the per-layer table that belong to no layer: the input batch and labels, the loss
INPUT_ROW, LOSS_ROW = "(input)", "(loss)"
_ACTIVATIONS = ("out", "pooled", "conv")


@dataclass(frozen=True)
class LayerMemory:
    """One row of the per-layer table: a layer's bytes by kind on one IPU."""

    name: str
    weights: int = 0
    gradients: int = 0
    activations: int = 0
    workspace: int = 0
    data: int = 0
    optimizer_state: int = 0
    #: serial pieces the layer runs its batch in (``engine.workspace``: a capped workspace)
    pieces: int = 1

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in KINDS)


@dataclass(frozen=True)
class MemoryPlan:
    """What one IPU holds while running a program, in bytes."""

    weights: int
    gradients: int
    activations: int
    workspace: int
    data: int
    optimizer_state: int
    capacity: int
    #: (layer name, bytes of its weights, gradients, buffers and optimizer state), largest first
    layers: tuple = field(default=(), compare=False)
    #: every layer's :class:`LayerMemory` in model order, then the input and loss rows: their
    #: kinds add up to the plan's
    by_layer: tuple = field(default=(), compare=False)

    @property
    def total(self) -> int:
        return sum(self.kinds().values())

    def kinds(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in KINDS}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:,}" for k, v in self.kinds().items())
        text = f"{self.total:,} bytes needed ({parts}), {self.capacity:,} available"
        if self.layers:
            text += "; largest layers: " + ", ".join(f"{n} {b:,}" for n, b in self.layers[:3])
        return text


def plan_memory(
    spec, batch: int, train: bool, itemsize: int, capacity: int, optimizer_state_bytes: int
) -> MemoryPlan:
    """The plan of one IPU running ``spec`` on ``batch`` examples; ``optimizer_state_bytes``
    is the whole model's state *on the device* (0 when it stays on the host), shared out to
    the layers by their parameter counts."""
    rows, n_params = [], max(1, spec.num_params)
    state = optimizer_state_bytes if train else 0
    given = seen = 0
    acc = accumulators(spec) if train else {}
    for i, layer in enumerate(spec.layers):
        lo, hi = spec.layer_ranges[i]
        acts = work = 0
        # the gradient accumulator of this layer's output, when several nodes read it
        out = acc.get(spec.graph.nodes[i].output)
        if out is not None:
            work += batch * math.prod(out) * itemsize
        for key, (shape, t) in layer.buffers(batch, train, need_dx=spec.need_dx[i]).items():
            n = math.prod(shape) * (itemsize if t == "f" else 1)
            if key in _ACTIVATIONS:
                acts += n
            else:
                work += n
        seen += hi - lo  # the flat layout need not follow layer order
        share = state * seen // n_params - given
        given += share
        w = (hi - lo) * itemsize
        frozen = getattr(layer, "frozen_size", 0) * itemsize  # held on the IPU, no gradient
        rows.append(
            LayerMemory(
                layer.name or f"layer {i}",
                w + frozen,
                w if train else 0,
                acts,
                work,
                0,
                share,
                workspace.pieces(batch, getattr(layer, "chunk", None)),
            )
        )
    labels, loss_work = loss_bytes(spec.loss, batch, spec.num_classes, itemsize)
    rows.append(
        LayerMemory(INPUT_ROW, data=batch * math.prod(spec.input_shape) * itemsize + labels)
    )
    rows.append(
        LayerMemory(
            LOSS_ROW,
            workspace=loss_work,
            optimizer_state=state - given,
        )
    )
    sums = {kind: sum(getattr(r, kind) for r in rows) for kind in KINDS}
    named = [(r.name, r.total) for r in rows[:-2]]
    return MemoryPlan(
        **sums,
        capacity=capacity,
        layers=tuple(sorted(named, key=lambda nb: -nb[1])),
        by_layer=tuple(rows),
    )


def host_optimizer_state(variables_on_host: bool, state_bytes: int) -> int:
    """Bytes of optimizer state the host holds: all of it unless it is resident on the IPU."""
    return state_bytes if variables_on_host else 0


def status_doc(
    plan: MemoryPlan, host_state_bytes: int, baseline: MemoryPlan | None = None, stages=None
) -> dict:
    """``/status``'s ``ipu_memory``: per IPU, bytes by kind and by layer, and the host's share;
    with recomputation the plan without it, with pipelining each stage's IPU."""
    doc = {
        "capacity": plan.capacity,
        "total": plan.total,
        "kinds": plan.kinds(),
        "layers": [asdict(r) for r in plan.by_layer],
        "host": {"optimizer_state": host_state_bytes},
    }
    if baseline is not None:
        doc["recompute"] = {"total": plan.total, "without_recompute": baseline.total}
    if stages:
        doc["stages"] = [
            {"ipu": s, "stage": s + 1, "total": p.total, "kinds": p.kinds()}
            for s, p in enumerate(stages)
        ]
    return doc


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.2f}"


def format_report(plan: MemoryPlan, host_state_bytes: int, title: str) -> str:
    """The readable table of ``ringtrain worker --report``: kinds, then layers by kind, each
    with MiB and % of the IPU's capacity."""
    cap = max(1, plan.capacity)
    pct = lambda n: f"{100 * n / cap:.2f}%"  # noqa: E731
    lines = [title, "", f"{'kind':<18}{'bytes':>14}{'MiB':>10}{'capacity':>10}"]
    for kind, n in plan.kinds().items():
        lines.append(f"{kind:<18}{n:>14,}{_mib(n):>10}{pct(n):>10}")
    lines.append(f"{'total':<18}{plan.total:>14,}{_mib(plan.total):>10}{pct(plan.total):>10}")
    lines.append(f"{'capacity':<18}{plan.capacity:>14,}{_mib(plan.capacity):>10}")
    lines.append(f"host: optimizer_state {host_state_bytes:,} bytes")
    width = max([len("layer")] + [len(r.name) for r in plan.by_layer]) + 2
    short = {
        "weights": "weights",
        "gradients": "grads",
        "activations": "activ",
        "workspace": "workspace",
        "data": "data",
        "optimizer_state": "opt_state",
    }
    lines += [
        "",
        f"{'layer':<{width}}"
        + "".join(f"{short[k]:>12}" for k in KINDS)
        + f"{'total':>13}{'capacity':>10}",
    ]
    for r in plan.by_layer:
        lines.append(
            f"{r.name:<{width}}"
            + "".join(f"{getattr(r, k):>12,}" for k in KINDS)
            + f"{r.total:>13,}{pct(r.total):>10}"
        )
    return "\n".join(lines)
