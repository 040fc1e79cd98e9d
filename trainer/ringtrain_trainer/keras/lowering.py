"""Lowering a Keras config into the engine: each layer's registry entry builds its op, the ops
are wired into a :class:`~ringtrain_trainer.engine.graph.Graph` (masks as nodes of their own,
shared layers tied, a Reshape/Flatten that moves no bytes dropped, a Conv2D+MaxPooling2D pair
fused), and the loss learns the outputs' shapes.

Apart from ``keras_model`` (the :class:`~ringtrain_trainer.keras.load.KerasModel` that owns
the result, its weights and its way back to Keras) because this is the one place that decides
which op runs for which layer: what Poplar's graph construction is for a real IPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.graph import Graph, Node
from ringtrain_trainer.engine.loss_spec import LossSpec
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activity, regularizers
from ringtrain_trainer.engine.ops.dropout import SharedDropout
from ringtrain_trainer.engine.ops.frozen import Frozen
from ringtrain_trainer.engine.ops.fused import ConvPool
from ringtrain_trainer.keras import outputs, shared
from ringtrain_trainer.keras.config import ModelConfig
from ringtrain_trainer.keras.entry import Build, without_folded
from ringtrain_trainer.keras.layer_spec import LayerSpec
from ringtrain_trainer.keras.layers_recurrent import in_op_dropout
from ringtrain_trainer.keras.mask_nodes import MaskWiring
from ringtrain_trainer.keras.registry import REGISTRY


@dataclass(frozen=True)
class Lowered:
    """What :func:`lower` made: the ops, their graph, per Keras layer the op holding its
    weights (None: folded away), the program's input shape (the Keras input after any leading
    Reshape/Flatten), each output's width, the loss that runs and the shared layers' ties."""

    ops: list
    graph: Graph
    owner: list[int | None]
    ipu_input: tuple
    widths: list[int]
    loss: LossSpec | MultiLossSpec
    ties: dict[int, int]


def _fuses(conv: LayerSpec, readers: list[LayerSpec]) -> bool:
    """Whether ``conv`` and its only reader run as one ``fused.ConvPool``."""
    if conv.cls != "Conv2D" or len(readers) != 1 or readers[0].cls != "MaxPooling2D":
        return False
    c, p, shape = conv.args, readers[0].args, conv.in_shapes[0]
    k = c["kernel_size"]
    return (
        p["pool_size"] == [2, 2]
        and p["strides"] == [2, 2]
        and p["padding"] == "valid"
        and k[0] == k[1]
        and c["strides"] == [1, 1]
        and c["padding"] == "valid"
        and c["activation"] == "relu"
        and c.get("dilation_rate", [1, 1]) == [1, 1]
        and c["use_bias"]
        and len(shape) == 3
        and min(shape[0], shape[1]) - k[0] + 1 >= 2
    )


#: Dropout draws are keyed by layer index; an RNN's input dropout uses its index plus this
RNN_DROPOUT_KEY = 1 << 20


def _input_dropout(s: LayerSpec, i: int, ops: list, nodes: list[Node], src: int) -> int:
    """An RNN's ``dropout`` as Keras 3 runs it without ``recurrent_dropout``: one mask per
    sequence over the input features, the same at every step (``LSTM.call`` draws it from
    the first step), scaled by ``1 / (1 - rate)``: a shared-mask Dropout node before the RNN,
    the identity outside training."""
    shape = tuple(s.in_shapes[0])
    op = SharedDropout(shape, s.args["dropout"], RNN_DROPOUT_KEY + i, (1, shape[-1]))
    op.name = f"{s.name}/input_dropout"
    n = len(ops)
    nodes.append(Node(n, (src,), n + 1))
    ops.append(op)
    return n + 1


def _moves_no_bytes(
    config: ModelConfig, s: LayerSpec, readers: list[LayerSpec], first: bool, last: bool
) -> bool:
    """A Reshape/Flatten that needs no op: the model's first layer on its only input (the
    program's input takes its shape) or a Flatten read only by a Dense (which reads its input
    flat anyway)."""
    if s.cls not in ("Reshape", "Flatten"):
        return False
    if first and s.inputs == (0,) and len(config.consumers(0)) == 1 and len(config.inputs) <= 1:
        return True
    return len(s.out_shape) == 1 and len(readers) == 1 and readers[0].cls == "Dense" and not last


def lower(config: ModelConfig) -> Lowered:
    """The engine ops and graph of ``config``'s layers (refusing, by layer, what cannot
    run), the ops that hold each layer's weights, and the loss as the outputs' shapes make it."""
    specs = config.layers
    #: every shared layer's name → its calls' spec indices (``keras.shared``)
    calls: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        calls.setdefault(s.shares or s.name, []).append(i)
    calls = {k: v for k, v in calls.items() if len(v) > 1}
    ops: list = []
    nodes: list[Node] = []
    #: Keras tensor → the IPU tensor holding it
    where: dict[int, int] = {x.tensor: x.tensor for x in config.inputs} or {0: 0}
    heads = outputs.heads(config)
    ipu_input = config.input_shape
    #: per Keras layer: the IPU op holding its weights (None: folded away)
    owner: list[int | None] = [None] * len(specs)
    done: set[int] = set()
    wiring = MaskWiring(config, ops, nodes, where)
    for i, s in enumerate(specs):
        if i in done:
            continue
        readers = config.consumers(s.output)
        last = s.output in heads
        reg = s.args.get("activity_regularizer")
        if reg is None and _moves_no_bytes(config, s, readers, first=not ops, last=last):
            if not ops:
                ipu_input = s.out_shape
            where[s.output] = where[s.inputs[0]]
            continue
        group = [s]
        roles, extra = wiring.inputs(s)
        op: Op | None
        if reg is None and _fuses(s, readers) and not last and (s.shares or s.name) not in calls:
            group.append(readers[0])
            done.add(specs.index(readers[0]))
            h, w, c = s.in_shapes[0]
            op = ConvPool((h, w, c), s.args["filters"], s.args["kernel_size"][0])
        else:
            fold = heads[s.output] if last else None
            try:
                built = without_folded(s, fold)
                op = REGISTRY[s.cls].build(built, list(s.in_shapes), Build(i, fold, roles))
            except ValueError as e:
                raise InvalidSpec(f"model: layer {s.name!r} ({s.cls}): {e}") from None
        if reg is not None and (op is None or fold is not None):
            raise InvalidSpec(
                f"model: layer {s.name!r} ({s.cls}): activity_regularizer on an output "
                "whose activation the loss computes is not supported"
            )
        if op is None:  # the identity (an activation folded into the loss)
            where[s.output] = where[s.inputs[0]]
            continue
        if s.frozen:
            op = Frozen(op, inference=s.cls == "BatchNormalization")
        if reg is not None:
            r = regularizers.parse(reg, "activity_regularizer")
            assert r is not None
            op = activity.WithActivity(op, r.l1, r.l2)
        op.name = "+".join(x.name for x in group)
        srcs = [where[t] for t in s.inputs]
        if (
            s.args.get("dropout")
            and s.cls in ("LSTM", "GRU", "SimpleRNN")
            and not in_op_dropout(s.cls, s.args)
        ):
            srcs[0] = _input_dropout(s, i, ops, nodes, srcs[0])
        n = len(ops)
        nodes.append(Node(n, (*srcs, *extra), n + 1))
        ops.append(op)
        for g in group:
            where[g.output] = n + 1
        owner[i] = n
    if not ops:
        raise InvalidSpec("model: the config has no layer with weights or computation")
    outs = config.outputs or (config.output,)
    shapes = [outputs.output_shape(config, ops, where, t) for t in outs]
    widths = [s[-1] for s in shapes]
    loss = config.loss
    if len(shapes[0]) > 1:  # a loss per position: the loss reads every position's row
        loss = dataclasses.replace(loss, out_shape=shapes[0])
    ins = config.inputs
    graph = Graph(
        nodes,
        tuple(x.tensor for x in ins) or (0,),
        tuple(where[t] for t in outs),
        frozenset(wiring.no_grad),
    )
    ties = shared.tie(ops, graph, [[owner[i] for i in v] for v in calls.values()], specs, calls)
    if len(ins) > 1:  # the program's ``x`` packs several inputs row-major
        ipu_input = (sum(math.prod(x.shape) for x in ins),)
    return Lowered(ops, graph, owner, tuple(ipu_input), widths, loss, ties)
