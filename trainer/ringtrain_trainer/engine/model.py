"""The model the engine runs: its ops, the graph that wires them and the flat parameter layout.

Pipeline position: :class:`ModelSpec` describes the layers, the graph that wires them (a chain
for Keras ``Sequential``) and the *parameter layout*; the emulated IPU (``ipu.device``)
compiles an ``engine.program.Program`` — every activation and workspace buffer for one batch
size, allocated once — and runs it every step.

Parameter layout and streaming grid: ``engine.plan`` (reverse backward order, bias before
kernel, as PyTorch DDP orders its buckets; row blocks of at most ``GRAD_BLOCK_ELEMS``), so every
group of finished gradients is a contiguous slice of the flat gradient buffer that the reducer
can hand to the allreduce without copying.

The ops themselves live in ``engine/ops/``, one family per file (``engine.op.Op`` protocol); the
fused ConvPool (``ops.fused``) is created by the lowering where it fits, the fast Dense inside
``ops.dense``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import plan
from ringtrain_trainer.engine.graph import Graph
from ringtrain_trainer.engine.loss_spec import LossSpec
from ringtrain_trainer.engine.plan import GRAD_BLOCK_ELEMS
from ringtrain_trainer.engine.program import Program
from ringtrain_trainer.engine.tensor import ParamSpec, Slot

if TYPE_CHECKING:
    from ringtrain_trainer.engine.multiloss import MultiLossSpec

__all__ = ["GRAD_BLOCK_ELEMS", "ModelSpec", "ParamSpec", "Program", "Slot"]


class ModelSpec:
    """Ops wired into a graph, plus the flat parameter layout (reverse backward order, bias
    before kernel). Without a ``graph`` the layers form a chain (Keras ``Sequential``).

    A model built from Keras (``keras.load.KerasModel``) also carries what the rest of the run
    reads of its source; a hand-built one leaves these at their defaults, so every reader asks
    the attribute, never ``getattr`` with a fallback."""

    #: the parsed Keras model (``keras.config.ModelConfig``); None for a hand-built model
    config: Any = None
    #: its mixed-precision settings (``optim.numerics.ModelNumerics``); None: fp32
    numerics: Any = None
    #: the input shape the source declared where it has None dims (fixed from the data)
    declared_input_shape: tuple[int, ...] | None = None
    #: several inputs: each one's own shape (the program's ``x`` packs them row-major)
    graph_input_shapes: list[tuple[int, ...]] | None = None
    #: parameters held frozen (``trainable=False``): state, never trained or reduced
    num_frozen: int = 0

    def __init__(
        self,
        name: str,
        layers: list,
        input_shape=(28, 28, 1),
        num_classes: int = 10,
        graph: Graph | None = None,
        loss: LossSpec | MultiLossSpec | None = None,
        ties: dict[int, int] | None = None,
    ):
        self.name, self.layers = name, layers
        #: a later call of a shared layer → the node whose parameters it uses
        #: (``engine.ops.shared``): its views are that node's
        self.ties = dict(ties or {})
        #: the compiled loss (``engine.losses``); the presets' sparse cross-entropy by default
        self.loss: LossSpec | MultiLossSpec = loss or LossSpec(
            "SparseCategoricalCrossentropy", {"from_logits": True}
        )
        self.input_shape, self.num_classes = input_shape, num_classes
        graph = Graph.chain(len(layers)) if graph is None else graph
        if len(graph.nodes) != len(layers):
            raise InvalidSpec(f"model {name!r}: {len(layers)} layers for a graph of nodes")
        #: a shared layer's later calls (``ties``) train the owner's parameters
        trainable = {i for i, layer in enumerate(layers) if layer.params(i)} | set(self.ties)
        self.graph = graph.without_grad_before(trainable)
        #: per node: whether it computes an input gradient (not when it reads only the data,
        #: nor when it writes a mask, nor when nothing before it trains)
        g = self.graph
        self.need_dx = [
            g.needs_grad(n.output) and any(g.needs_grad(t) for t in n.inputs) for n in g.nodes
        ]
        backward = self.graph.backward_order()
        self.slots, self.num_params = plan.layout(
            backward, [layer.params(i) for i, layer in enumerate(layers)]
        )
        #: per layer: (start, stop) of its contiguous slice of the flat buffer
        self.layer_ranges = []
        offset = self.num_params
        for li in range(len(layers)):
            mine = [s for s in self.slots if s.spec.layer == li]
            self.layer_ranges.append(
                (min(s.start for s in mine), max(s.stop for s in mine))
                if mine
                else (offset, offset)
            )
            offset = self.layer_ranges[-1][0]
        self.set_grid(plan.GRAD_BLOCK_ELEMS)
        #: non-trainable state (BatchNormalization's moving statistics): per layer
        #: (name, size, initial value), laid out in forward layer order; never reduced
        self.state_specs = [layer.state_specs() for layer in layers]
        self.state_size = sum(n for specs in self.state_specs for _, n, _ in specs)
        #: the ranges of the state that training updates (moving statistics), merged: what
        #: replicas average after a step; a frozen op's state never changes (``engine.ops.frozen``)
        self.live_state: list[tuple[int, int]] = []
        at = 0
        for layer, specs in zip(layers, self.state_specs, strict=True):
            n = sum(size for _, size, _ in specs)
            if n and not hasattr(layer, "frozen_size"):
                if self.live_state and self.live_state[-1][1] == at:
                    self.live_state[-1] = (self.live_state[-1][0], at + n)
                else:
                    self.live_state.append((at, at + n))
            at += n

    def set_grid(self, block_elems: int) -> None:
        """Cut the streamed gradient pieces (``engine.plan.piece_grid``) at ``block_elems``;
        before anything is compiled (``engine.plan.block_elems_for`` says which)."""
        #: the pieces in the order backward writes them: what the Program announces ready
        self.pieces = plan.piece_grid(self.slots, block_elems)
        #: the same as (start, stop) of the flat buffer
        self.grad_pieces = [p.range for p in self.pieces]
        #: the same pieces as sizes, grouped by parameter in arrival order: what the reducer
        #: plans its buckets from, so a bucket always ends where a streamed piece ends
        self.param_pieces: list[list[int]] = []
        last = None
        for p in self.pieces:
            if (p.node, p.name) != last:
                self.param_pieces.append([])
                last = p.node, p.name
            self.param_pieces[-1].append(p.stop - p.start)

    def views(self, flat: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Per layer, name → view into ``flat`` shaped like the parameter."""
        out: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        for s in self.slots:
            out[s.spec.layer][s.spec.name] = flat[s.start : s.stop].reshape(s.spec.shape)
        for i, owner in self.ties.items():
            out[i] = out[owner]
        return out

    def init_state(self, dtype=np.float32) -> np.ndarray:
        return np.concatenate(
            [np.full(n, v, dtype) for specs in self.state_specs for _, n, v in specs]
            or [np.zeros(0, dtype)]
        )

    def state_views(self, state: np.ndarray) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = []
        at = 0
        for specs in self.state_specs:
            out.append({})
            for name, n, _ in specs:
                out[-1][name], at = state[at : at + n], at + n
        return out

    def init(self, seed: int, dtype=np.float32) -> np.ndarray:
        """Each parameter's Keras initializer (default: Glorot-uniform kernels, zero biases),
        drawn in forward layer order."""
        flat = np.zeros(self.num_params, dtype)
        rng = np.random.Generator(np.random.PCG64(seed))
        for s in sorted(self.slots, key=lambda s: (s.spec.layer, s.spec.name != "kernel")):
            if s.spec.init is not None:
                flat[s.start : s.stop] = s.spec.init(s.spec.shape, rng, dtype).ravel()
            elif s.spec.glorot:
                limit = math.sqrt(6.0 / (s.spec.fan_in + s.spec.fan_out))
                flat[s.start : s.stop] = rng.uniform(-limit, limit, s.spec.size)
            elif s.spec.ones:
                flat[s.start : s.stop] = 1
        return flat

    def penalty(self, flat: np.ndarray) -> float:
        """The weight regularizers' penalty at ``flat`` (what Keras adds to its loss); the
        training step's own comes from the optimizer, without allocating."""
        return sum(s.spec.reg.loss(flat[s.start : s.stop]) for s in self.slots if s.spec.reg)

    def flops_per_example(self, train: bool = True) -> int:
        return sum(layer.flops(1, train, self.need_dx[i]) for i, layer in enumerate(self.layers))
