"""One compiled (model, batch size, train/eval) program: every buffer allocated up front, the
graph walked in topological order forward and in reverse backward.

Pipeline position: the emulated IPU (``ipu``) compiles one :class:`Program` per shard and runs
it every step; ``model.ModelSpec`` supplies the ops, the :class:`~.graph.Graph` and the
parameter layout. Nothing here allocates per step (tests/trainer/test_trainer_model.py checks
it): activations, workspaces and one gradient accumulator per fanned-out tensor are planned here
once, and a step only writes into them.

Gradient accumulation: a tensor read by several nodes gets the sum of their input gradients.
Backward runs in reverse topological order, so every consumer of a tensor has run before its
producer; the first contribution (fixed at compile time) is copied into the tensor's
accumulator and the others are added to it. A tensor read once needs no accumulator: its
gradient is the consumer's own input-gradient buffer, as before the graph existed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ringtrain_trainer.engine.multiloss import loss_bytes, make_loss

#: how a node's input gradient reaches its tensor: dropped (the data), taken as is (fan-out 1),
#: copied into the accumulator (first of several) or added to it
_SKIP, _TAKE, _COPY, _ADD = range(4)
#: a layer's buffer kinds: "f" the program's dtype, "u" the compiled kernels' one-byte
#: indices, any other a boolean mask
_KINDS = {"u": np.uint8}


def _contributions(graph, fanned: set[int]) -> list[list[tuple[int, int, int]]]:
    """Per node (by index): ``(input position, tensor, mode)`` for each of its inputs, the modes
    decided once from the backward schedule."""
    seen: set[int] = set()
    plan: list[list[tuple[int, int, int]]] = [[] for _ in graph.nodes]
    for i in graph.backward_order():
        for k, t in enumerate(graph.nodes[i].inputs):
            if not graph.needs_grad(t) or not graph.needs_grad(graph.nodes[i].output):
                mode = _SKIP
            elif t not in fanned:
                mode = _TAKE
            else:
                mode = _ADD if t in seen else _COPY
                seen.add(t)
            plan[i].append((k, t, mode))
    return plan


def _node_pieces(spec) -> list[list[tuple[str, tuple[int, int], tuple[int, int]]]]:
    """The plan's piece grid (``spec.pieces``) regrouped per node as (parameter, rows of its
    matrix view, flat range): what the backward schedule asks each op for, and announces."""
    out: list[list] = [[] for _ in spec.layers]
    for p in spec.pieces:
        out[p.node].append((p.name, p.rows, p.range))
    return out


def tensor_shapes(spec) -> dict[int, tuple[int, ...]]:
    """Per-example shape of every tensor of ``spec.graph``."""
    graph = spec.graph
    own = spec.graph_input_shapes or [spec.input_shape] * len(graph.inputs)
    shapes = {t: tuple(s) for t, s in zip(graph.inputs, own, strict=True)}
    for n in graph.nodes:
        shapes[n.output] = tuple(spec.layers[n.index].out_shape)
    return shapes


def accumulators(spec) -> dict[int, tuple[int, ...]]:
    """The tensors whose gradients are sums (fanned out and needing a gradient), with their
    per-example shapes: one accumulator buffer each in a training program."""
    shapes, graph = tensor_shapes(spec), spec.graph
    return {t: shapes[t] for t in graph.fanned_out() if graph.needs_grad(t)}


class Program:
    """One compiled (model, batch size, train/eval) program: every buffer allocated up front.

    ``forward`` / ``backward_pieces`` allocate nothing; ``backward_pieces`` yields each gradient
    piece of ``spec.grad_pieces`` right after it is written (last node of the backward schedule
    first), which is how the IPU streams gradients out while backward continues.
    """

    def __init__(
        self,
        spec,
        batch: int,
        train: bool,
        dtype=np.float32,
        grads_first: bool = False,
        state: np.ndarray | None = None,
        nodes: frozenset[int] | None = None,
    ):
        self.spec, self.batch, self.train, self.dtype = spec, batch, train, np.dtype(dtype)
        self.graph = graph = spec.graph
        #: set by the IPU before each run: what Dropout's masks depend on (``layers``)
        self.ctx: dict[str, float] = {"seed": 0, "step": 0, "example0": 0}  # and "loss_scale"
        #: this program's copy of the model's non-trainable state (``ModelSpec.state_specs``)
        self.state = spec.init_state(self.dtype) if state is None else state
        state_views = spec.state_views(self.state)
        #: stream each node's weight gradients before its input gradient (``backward_pieces``)
        self.grads_first = grads_first
        self.ws: list[dict] = []
        for node, layer in zip(graph.nodes, spec.layers, strict=True):
            if nodes is not None and node.index not in nodes:  # another pipeline stage's
                self.ws.append({})
                continue
            bufs = layer.buffers(batch, train, need_dx=spec.need_dx[node.index])
            # a node's buffers, its state views, the run's ``ctx`` (and a tie's ``owner``)
            ws: dict[str, Any] = {
                k: np.zeros(shape, self.dtype if t == "f" else _KINDS.get(t, np.bool_))
                for k, (shape, t) in bufs.items()
            }
            ws.update(state_views[node.index], ctx=self.ctx)
            layer.bind(ws, batch)
            self.ws.append(ws)
        for i, owner in spec.ties.items():  # a shared layer's later calls
            self.ws[i]["owner"] = self.ws[owner]  # add their weight gradients to the owner's
        self.x = np.zeros((batch, *spec.input_shape), self.dtype)
        #: the compiled loss (``engine.losses``, or ``engine.multiloss`` for several outputs):
        #: its label buffer and dloss/doutput
        self.loss = make_loss(spec.loss, batch, spec.num_classes, dtype)
        self.labels = self.loss.labels
        self.dlogits = self.loss.grad
        #: the nodes this program runs (``engine.pipeline``: one stage's); None: all
        self.nodes = nodes
        #: the value of every tensor this step (views of the nodes' own buffers)
        self.tensors: dict[int, np.ndarray | None] = dict.fromkeys(graph.tensors)
        self._split_in: list[tuple[np.ndarray, np.ndarray]] = []
        self._pack_out: list[tuple[np.ndarray, int]] = []
        self._packed: np.ndarray | None = None
        if len(graph.inputs) == 1:
            self.tensors[graph.inputs[0]] = self.x
        else:  # several inputs: ``x`` packs them row-wise; each gets its own buffer
            at, own = 0, tensor_shapes(spec)
            for t in graph.inputs:
                buf = np.zeros((batch, *own[t]), self.dtype)
                n = math.prod(own[t])
                self._split_in.append((self.x[:, at : at + n], buf.reshape(batch, n)))
                self.tensors[t], at = buf, at + n
        if len(graph.outputs) > 1:  # several outputs: packed side by side for the loss
            self._packed = np.zeros((batch, spec.num_classes), self.dtype)
        #: gradient accumulators of the fanned-out tensors (training programs only)
        self.acc = (
            {
                t: np.zeros((batch, *s), self.dtype)
                for t, s in accumulators(spec).items()
                if nodes is None or any(c in nodes for c in graph.consumers[t])
            }
            if train
            else {}
        )
        self._contrib = _contributions(graph, set(self.acc))
        self._grads: dict[int, np.ndarray | None] = dict.fromkeys(graph.tensors)
        #: per node: (parameter, its rows, the flat range) for each gradient piece it streams
        self._pieces = _node_pieces(spec)
        #: mixed precision (``engine.precision``): rounds every node's output and input
        #: gradient to float16 in place; None in float32
        self.rounder: Callable[[np.ndarray], None] | None = None

    @property
    def output(self) -> np.ndarray:
        """The graph's output (the logits) as the last forward left it; several outputs:
        packed side by side (``engine.multiloss``)."""
        if self._packed is not None:
            return self._packed
        return self.tensor(self.graph.outputs[0])

    def tensor(self, t: int) -> np.ndarray:
        """Tensor ``t`` as this step computed it (read after the node that writes it ran)."""
        v = self.tensors[t]
        assert v is not None, f"tensor {t} read before it was computed"
        return v

    def tensor_grad(self, t: int) -> np.ndarray:
        """Tensor ``t``'s gradient as this step's backward delivered it."""
        g = self._grads[t]
        assert g is not None, f"gradient of tensor {t} read before it was delivered"
        return g

    def pack_outputs(self) -> np.ndarray:
        """:attr:`output` after a forward (several outputs: copied side by side)."""
        if self._packed is not None:
            at = 0
            for t in self.graph.outputs:
                z = self.tensor(t)
                k = z.shape[1]
                np.copyto(self._packed[:, at : at + k], z)
                at += k
        return self.output

    @staticmethod
    def buffer_bytes(spec, batch: int, train: bool, itemsize: int = 4) -> dict[str, int]:
        """Bytes of activations and workspace this program allocates (the IPU's memory plan)."""
        acts = work = 0
        for i, layer in enumerate(spec.layers):
            for key, (shape, t) in layer.buffers(batch, train, need_dx=spec.need_dx[i]).items():
                n = math.prod(shape) * (itemsize if t == "f" else 1)
                if key in ("out", "pooled", "conv"):
                    acts += n
                else:
                    work += n
        if train:
            work += sum(batch * math.prod(s) * itemsize for s in accumulators(spec).values())
        labels, loss_work = loss_bytes(spec.loss, batch, spec.num_classes, itemsize)
        data = batch * math.prod(spec.input_shape) * itemsize + labels
        work += loss_work
        return {"activations": acts, "workspace": work, "data": data}

    def forward(
        self, params: list[dict[str, np.ndarray]], on_layer: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Logits; ``on_layer(i)`` (a tracer's lap) after each node ``i``."""
        self.split_inputs()
        for i in self.graph.order:
            self.forward_node(i, params)
            if on_layer is not None:
                on_layer(i)
        return self.pack_outputs()

    def split_inputs(self) -> None:
        """Several inputs: each one's columns of the packed ``x`` into its own buffer."""
        for packed, own in self._split_in:
            np.copyto(own, packed)

    def forward_node(self, i: int, params: list[dict[str, np.ndarray]]) -> None:
        """Node ``i``'s forward, reading and writing :attr:`tensors` (recompute and pipeline
        stages run the graph in parts with this)."""
        node, tensors = self.graph.nodes[i], self.tensors
        out = self.spec.layers[i].forward(
            self.ws[i], *[tensors[t] for t in node.inputs], **params[i]
        )
        tensors[node.output] = out
        if self.rounder is not None:
            self.rounder(out)

    def loss_and_dlogits(self, logits: np.ndarray) -> float:
        """The model's loss (``engine.losses``), mean over the local batch in ``labels``;
        writes dloss/doutput into ``dlogits``; plus the activity regularizers' terms
        (``ops.activity``), as Keras' loss includes them."""
        loss = self.loss.step(logits)
        for layer, ws in zip(self.spec.layers, self.ws, strict=True):
            if hasattr(layer, "penalty"):
                loss += layer.penalty(ws)
        return loss

    def train_forward(
        self,
        params: list[dict[str, np.ndarray]],
        on_layer: Callable[[int], None] | None,
        loss_scale: float,
    ) -> float:
        """A training step's first half: forward, the loss, and dloss/doutput times the loss
        scale, rounded like every gradient (float16): what backward starts from."""
        loss = self.loss_and_dlogits(self.forward(params, on_layer))
        self.ctx["loss_scale"] = loss_scale  # the activity regularizers scale their gradient too
        if loss_scale != 1.0:
            np.multiply(self.dlogits, self.dtype.type(loss_scale), out=self.dlogits)
        if self.rounder is not None:
            self.rounder(self.dlogits)
        return loss

    def _deliver(self, i: int, dxs) -> None:
        """Route node ``i``'s input gradients to their tensors (take, copy or accumulate)."""
        if len(self.graph.nodes[i].inputs) == 1:
            dxs = (dxs,)
        if self.rounder is not None:
            for d in dxs:
                if d is not None:
                    self.rounder(d)
        grads, acc = self._grads, self.acc
        for k, t, mode in self._contrib[i]:
            if mode == _TAKE:
                grads[t] = dxs[k]
            elif mode == _COPY:
                np.copyto(acc[t], dxs[k].reshape(acc[t].shape))
                grads[t] = acc[t]
            elif mode == _ADD:
                a = acc[t]
                np.add(a, dxs[k].reshape(a.shape), out=a)

    def backward_pieces(
        self,
        params: list[dict[str, np.ndarray]],
        grads: list[dict[str, np.ndarray]],
        on_layer: Callable[[int], None] | None = None,
    ):
        """Generator: backward in reverse topological order, yielding each ``(start, stop)`` of
        ``spec.grad_pieces`` once those gradients are written, so replicas and shards can run
        in lock step piece by piece.

        The order of each node's two halves is decided here, for every op alike. By default
        the input gradient, which the node below waits for, comes first (the critical path, as
        frameworks schedule it) — required when the weights are resident on the IPU, because
        the host optimizer may then update a streamed kernel block at once and nothing may read
        the kernel after it. ``grads_first`` (weights streamed in, so the optimizer never
        touches what backward reads) streams the weight gradients first, so the host's
        allreduce starts earlier and the input gradient hides part of it. Either way the
        arithmetic is the same."""
        self.seed_output_grads()
        for i in self.graph.backward_order():
            yield from self.backward_node(i, params, grads)
            if on_layer is not None:
                on_layer(i)

    def seed_output_grads(self) -> None:
        """dloss/doutput as each output tensor's gradient (several outputs: each one's block
        of the packed loss gradient)."""
        if len(self.graph.outputs) == 1:
            self._grads[self.graph.outputs[0]] = self.dlogits
        else:
            for t, block in zip(self.graph.outputs, self.loss.blocks, strict=True):
                self._grads[t] = block

    def backward_node(self, i: int, params, grads):
        """Generator: node ``i``'s backward (see :meth:`backward_pieces`), yielding each of its
        gradient pieces once written; its input gradients are delivered at the end."""
        if not self.graph.needs_grad(self.graph.nodes[i].output):
            return  # a mask, or nothing before it trains: no backward at all
        layer, ws, p = self.spec.layers[i], self.ws[i], params[i]
        dout = self._grads[self.graph.nodes[i].output]
        need_dx, first = self.spec.need_dx[i], self.grads_first
        layer.backward_local(ws, dout)
        if need_dx and not first:
            dx = layer.backward_input(ws, dout, **p)
        for name, rows, piece in self._pieces[i]:
            layer.backward_weights(ws, dout, name, grads[i][name], rows)
            yield piece
        if need_dx:
            if first:
                dx = layer.backward_input(ws, dout, **p)
            self._deliver(i, dx)
