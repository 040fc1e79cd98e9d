"""Keras masks as nodes of the engine's graph: each mask built once, read by the layers that
consume it (``keras.masks`` says which tensor carries which mask; this module wires it).

Apart from ``keras_model`` because the mask tensors are graph nodes of their own (``no_grad``:
no backward runs through them) that the model's layer loop only asks for by key.
"""

from __future__ import annotations

from ringtrain_trainer.engine.graph import Node
from ringtrain_trainer.engine.ops.mask import AttentionMask, ComputeMask
from ringtrain_trainer.keras import masks
from ringtrain_trainer.keras.config import ModelConfig
from ringtrain_trainer.keras.layer_spec import LayerSpec


class MaskWiring:
    """Builds each Keras mask (``keras.masks``) once, as a node of the graph that writes a
    ``no_grad`` tensor, and says which masks a layer's node reads after its inputs."""

    def __init__(self, config: ModelConfig, ops: list, nodes: list[Node], where: dict[int, int]):
        self.masks = masks.propagate(config.layers, config.outputs)
        self.ops, self.nodes, self.where = ops, nodes, where
        self.shapes = {x.tensor: tuple(x.shape) for x in config.inputs}
        self.shapes.update({s.output: tuple(s.out_shape) for s in config.layers})
        #: mask key → the IPU tensor holding it
        self.made: dict[masks.Key, int] = {}
        #: every tensor a mask node writes (attention's combined masks too)
        self.no_grad: set[int] = set()

    def _node(self, op, inputs: tuple[int, ...]) -> int:
        n = len(self.ops)
        op.name = f"mask{n}"
        self.nodes.append(Node(n, inputs, n + 1))
        self.ops.append(op)
        self.no_grad.add(n + 1)
        return n + 1

    def tensor(self, key: masks.Key) -> int:
        if key not in self.made:
            if key[0] == "or":
                srcs = tuple(self.tensor(k) for k in key[1])
                shape = self.ops[srcs[0] - 1].out_shape
                self.made[key] = self._node(ComputeMask(shape, "or", n=len(srcs)), srcs)
            else:
                value = key[2] if key[0] == "value" else 0.0
                op = ComputeMask(self.shapes[key[1]], key[0], value)
                self.made[key] = self._node(op, (self.where[key[1]],))
        return self.made[key]

    def inputs(self, s: LayerSpec) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(the mask roles of ``Build.mask``, the mask tensors) layer ``s``'s node reads."""
        if s.cls == "Masking":
            return ("input",), (self.tensor(("value", s.inputs[0], s.args["mask_value"])),)
        if s.cls not in masks.CONSUME:
            return (), ()
        ins = [self.masks.get(t) for t in s.inputs]
        if s.cls != "MultiHeadAttention":
            return (("input",), (self.tensor(ins[0]),)) if ins[0] is not None else ((), ())
        srcs = masks.attention_sources(s, ins)
        if not srcs:
            return (), ()
        T, S = s.in_shapes[0][0], s.in_shapes[min(1, len(s.in_shapes) - 1)][0]
        op = AttentionMask(T, S, tuple(r for r, _ in srcs))
        made = self._node(op, tuple(self.tensor(k) for _, k in srcs))
        return tuple(r for r, _ in srcs), (made,)
