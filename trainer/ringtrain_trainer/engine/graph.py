"""The model as a graph: nodes, the tensors between them, topological order, fan-out; pure.

Why a graph and not a list: a tensor read by two nodes (a residual ``Add``) must sum two
gradient contributions, and a node with several inputs (``Add``, ``Concatenate``) needs one
gradient per input. A chain (Keras ``Sequential``) is the special case every node of which
reads its predecessor's output, so today's models keep their node (= layer) indices.

Tensors are small integers. A graph input is a tensor no node produces; every node produces
exactly one tensor. The backward schedule is the reverse of :attr:`Graph.order`, so by the
time a node runs backward every consumer of its output has already contributed its gradient.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    """One op application: the tensors it reads, in its own argument order, and the one it
    writes. ``index`` is the op's position in the model's op list (its layer index)."""

    index: int
    inputs: tuple[int, ...]
    output: int


class GraphError(ValueError):
    """A graph that cannot run: a tensor read before anything writes it, written twice, or a
    cycle. Raised at construction, before any buffer is planned."""


class Graph:
    """Nodes and tensors; :attr:`order` (topological, ties by node index), :attr:`consumers`
    (the fan-out map: tensor → the nodes that read it, in forward order); a node writing a
    :attr:`no_grad` tensor (a mask) passes no gradient to what it reads."""

    def __init__(
        self,
        nodes: list[Node],
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        no_grad: frozenset[int] = frozenset(),
    ):
        self.nodes, self.inputs, self.outputs = list(nodes), tuple(inputs), tuple(outputs)
        #: tensors that take no gradient besides the inputs: Keras masks, computed once per
        #: batch from the data (``ops.mask``); the nodes writing them run no backward
        self.no_grad = frozenset(no_grad)
        if [n.index for n in self.nodes] != list(range(len(self.nodes))):
            raise GraphError("node indices must be 0..n-1 in list order")
        producer: dict[int, int] = {}
        for n in self.nodes:
            if n.output in producer or n.output in self.inputs:
                raise GraphError(f"tensor {n.output} is written twice (node {n.index})")
            producer[n.output] = n.index
        #: tensor → the node that writes it (graph inputs have none)
        self.producer = producer
        for n in self.nodes:
            for t in n.inputs:
                if t not in producer and t not in self.inputs:
                    raise GraphError(f"node {n.index} reads tensor {t}, which nothing writes")
        for t in self.outputs:
            if t not in producer and t not in self.inputs:
                raise GraphError(f"graph output {t} is never written")
        self.order = self._toposort()
        consumers: dict[int, list[int]] = {t: [] for t in (*self.inputs, *producer)}
        for i in self.order:
            for t in self.nodes[i].inputs:
                if i not in consumers[t]:
                    consumers[t].append(i)
        self.consumers = {t: tuple(c) for t, c in consumers.items()}

    @classmethod
    def chain(cls, n: int) -> Graph:
        """Sequential: node ``i`` reads tensor ``i`` and writes ``i + 1``; tensor 0 is the input."""
        return cls([Node(i, (i,), i + 1) for i in range(n)], (0,), (n,))

    def _toposort(self) -> list[int]:
        """Kahn's algorithm, always taking the lowest ready node index: a chain keeps its order."""
        waiting = {n.index: len({t for t in n.inputs if t in self.producer}) for n in self.nodes}
        readers: dict[int, list[int]] = {}
        for n in self.nodes:
            for t in set(n.inputs):
                readers.setdefault(t, []).append(n.index)
        ready = [i for i, k in waiting.items() if k == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in readers.get(self.nodes[i].output, ()):
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(self.nodes):
            stuck = sorted(set(waiting) - set(order))
            raise GraphError(f"the graph has a cycle through nodes {stuck}")
        return order

    @property
    def tensors(self) -> list[int]:
        """Every tensor: the inputs, then each node's output in topological order."""
        return [*self.inputs, *(self.nodes[i].output for i in self.order)]

    def fanned_out(self) -> list[int]:
        """Tensors read by more than one node (or twice by one): their gradients are sums, so
        each gets one planned accumulator buffer."""
        grads = [n for n in self.nodes if self.needs_grad(n.output)]
        return [t for t in self.tensors if sum(n.inputs.count(t) for n in grads) > 1]

    def without_grad_before(self, trainable: set[int]) -> Graph:
        """This graph with every tensor that no trainable node (``trainable``: node indices
        with parameters to train) produces or precedes added to :attr:`no_grad`: backward
        stops where nothing upstream trains, as a tape records no gradient there (a frozen
        base under a new head: its layers run forward only)."""
        upstream: dict[int, bool] = dict.fromkeys(self.inputs, False)
        for i in self.order:
            n = self.nodes[i]
            upstream[n.output] = i in trainable or any(upstream[t] for t in n.inputs)
        free = {t for t, up in upstream.items() if not up and t not in self.inputs}
        return Graph(self.nodes, self.inputs, self.outputs, self.no_grad | free)

    def needs_grad(self, t: int) -> bool:
        """Whether backward computes a gradient for tensor ``t``: every tensor but the graph's
        inputs (the data) and the masks derived from them (:attr:`no_grad`)."""
        return t not in self.inputs and t not in self.no_grad

    def backward_order(self) -> list[int]:
        """The backward schedule: the reverse topological order."""
        return self.order[::-1]
