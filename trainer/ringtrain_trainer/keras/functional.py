"""A Functional config's graph: ``inbound_nodes`` (Keras 3 and tf.keras 2) into layer specs.

Apart from :mod:`.config` (which owns the specs, the input layers and the Sequential chain)
because reading a graph — tensor histories, several inputs and outputs, the Keras mask
operations spelled out as nodes, Keras' own layer order — is its own concern, and every rule
here follows one Keras function: ``functional_from_config`` (build each layer once its inputs
exist) and ``map_graph`` (the order ``get_weights()`` follows).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import masks, ops_numpy
from ringtrain_trainer.keras.layer_spec import (
    InputSpec,
    LayerSpec,
    Shape,
    check_shape,
    input_dtype,
    input_layer,
    make_spec,
    unsupported,
)


def history(v: Any, where: str) -> list[tuple[str, int, int]]:
    """Every ``keras_history`` in a Keras 3 node's args, in order, however nested."""
    if isinstance(v, dict):
        if v.get("class_name") == "__keras_tensor__":
            h = (v.get("config") or {}).get("keras_history")
            if not isinstance(h, list) or len(h) != 3:
                raise InvalidSpec(f"model: {where}: a tensor without keras_history")
            return [(str(h[0]), int(h[1]), int(h[2]))]
        return [t for x in v.values() for t in history(x, where)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in history(x, where)]
    if v is not None:  # layer(x, True): an argument the layer would get and ringtrain would not
        raise InvalidSpec(f"model: {where}: call argument {v!r} is not supported (supported: none)")
    return []


def _holds_tensor(v: Any) -> bool:
    """Whether a call argument is (or holds) a Keras tensor, however nested."""
    if isinstance(v, dict):
        return v.get("class_name") == "__keras_tensor__" or any(map(_holds_tensor, v.values()))
    return isinstance(v, (list, tuple)) and any(map(_holds_tensor, v))


def _node_inputs(layer: dict, where: str) -> tuple[list[tuple[str, int, int]], dict]:
    """The tensors a layer's one node reads, and its call arguments that are set (Keras 3;
    a call argument holding a tensor is refused: one model input only)."""
    nodes = layer.get("inbound_nodes") or []
    if len(nodes) != 1:
        raise InvalidSpec(
            f"model: {where} is called {len(nodes)} times: shared layers are not supported "
            "(supported: each layer called once in a tf.keras 2 config; a Keras 3 config may "
            "share layers)"
        )
    node = nodes[0]
    if isinstance(node, dict):  # Keras 3
        kwargs = {}
        for k, v in (node.get("kwargs") or {}).items():
            if k == "mask" and _holds_tensor(v):  # a spelled-out Keras mask: keras.masks
                kwargs[k] = tuple(history(v, where))
                continue
            if _holds_tensor(v):
                raise InvalidSpec(
                    f"model: {where}: call argument {k} is a tensor (supported: none)"
                )
            if v not in (None, False):
                kwargs[k] = v
        return history(node.get("args") or [], where), kwargs
    out = []  # tf.keras 2: [[layer, node, tensor, kwargs], ...]
    for t in node if isinstance(node, list) else []:
        if not isinstance(t, list) or len(t) < 3:
            raise InvalidSpec(f"model: {where}: an inbound node entry {t!r} is not readable")
        if len(t) > 3 and t[3]:
            raise InvalidSpec(
                f"model: {where}: call arguments {t[3]!r} are not supported (supported: none)"
            )
        out.append((str(t[0]), int(t[1]), int(t[2])))
    return out, {}


def _ends(v: Any, what: str) -> list[tuple[str, int, int]]:
    """``input_layers`` / ``output_layers``: one ``[name, node, tensor]`` or a list of them."""
    if isinstance(v, list) and len(v) == 3 and isinstance(v[0], str):
        v = [v]
    if isinstance(v, dict):  # keras.Model({"a": a}, {"y": y}): keyed, sorted by key in Keras
        raise InvalidSpec(
            f"model: {what} as a dict ({', '.join(map(repr, v))}) is not supported "
            "(supported: a list, keras.Model([a, b], [c, d]), named by the layers)"
        )
    if not isinstance(v, list) or not v or not all(isinstance(x, list) and len(x) == 3 for x in v):
        raise InvalidSpec(f"model: {what}={v!r} is not readable")
    return [(str(x[0]), int(x[1]), int(x[2])) for x in v]


def read_graph(
    cfg: dict,
) -> tuple[tuple[InputSpec, ...], list[LayerSpec], tuple[int, ...], tuple[str, ...]]:
    """A Functional config's inputs, layers (in Keras' ``model.layers`` order), output tensors
    and output names; every layer built once its inputs exist, as Keras'
    ``functional_from_config`` does."""
    layers = cfg.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidSpec("model: the Functional config has no layers")
    ins, outs = (
        _ends(cfg.get("input_layers"), "input_layers"),
        _ends(cfg.get("output_layers"), "output_layers"),
    )
    tensors: dict[tuple[str, int, int], int] = {}
    shapes: dict[int, Shape] = {}
    #: model input k is tensor -k (0 for the first, as a one-input model has always had)
    in_ids = _input_ids(ins)
    found: dict[int, tuple[str, Shape, str]] = {}
    pending = []
    mask_ops: dict[tuple[str, int, int], tuple[str, list, dict]] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise unsupported(layer, i)
        if ops_numpy.is_operation(layer) and masks.is_mask_op(*_mask_op(layer, raw=True)):
            mask_ops[(str(layer.get("name")), 0, 0)] = _mask_op(layer)
            continue
        if ops_numpy.is_operation(layer):  # ``x + 3.0`` on Keras tensors
            layer = ops_numpy.as_layer(layer)
        name = str(layer.get("name") or (layer.get("config") or {}).get("name") or i)
        if layer.get("class_name") == "InputLayer":
            if (name, 0, 0) not in in_ids:
                raise InvalidSpec(f"model: InputLayer {name!r} is not one of the model's inputs")
            t = in_ids[(name, 0, 0)]
            shape = check_shape(input_layer(layer, i)[1])
            tensors[(name, 0, 0)], shapes[t] = t, shape
            found[t] = (name, shape, input_dtype(layer))
        elif layer.get("inbound_nodes"):  # a layer never called is not part of the model
            where = f"layer {name!r} ({layer.get('class_name')})"
            pending.append((layer, name, *_node_inputs(layer, where)))
    for (in_name, _, _), t in in_ids.items():
        if t not in found:
            raise InvalidSpec(f"model: input_layers names {in_name!r}, which is no InputLayer")
    specs: list[LayerSpec] = []
    spelled: list[tuple[LayerSpec, tuple, str]] = []
    while pending:  # the first layer (in config order) whose inputs exist, as Kahn's
        p = next((p for p in pending if all(h in tensors for h in p[2])), None)
        if p is None:
            layer, name, hist, _ = pending[0]
            missing = next(h for h in hist if h not in tensors)
            raise InvalidSpec(
                f"model: layer {name!r} ({layer.get('class_name')}) reads {list(missing)}, "
                "which no layer of the model writes once (a shared layer, a layer's second "
                "output or a cycle are not supported)"
            )
        layer, name, hist, call = p
        pending.remove(p)
        t_in = tuple(tensors[h] for h in hist)
        mask = call.pop("mask", None)
        s = make_spec(layer, len(specs), t_in, [shapes[t] for t in t_in], call)
        specs.append(s)
        if mask is not None:
            spelled.append((s, mask, f"layer {name!r} ({s.cls})"))
        tensors[(name, 0, 0)], shapes[s.output] = s.output, s.out_shape
    out_ids = _output_ids(outs, tensors, specs)
    derived = masks.propagate(specs, tuple(out_ids))
    for s, mask, where in spelled:

        def rank(t: int) -> int:
            return len(shapes[t])

        if len(mask) != 1 or masks.key_of(mask[0], mask_ops, tensors, rank, where) != derived.get(
            s.inputs[0]
        ):
            raise InvalidSpec(
                f"model: {where}: its mask argument is not the mask Keras propagates to it "
                "(supported: the propagated mask of Embedding(mask_zero=True) or Masking)"
            )
    writers = [next(s.name for s in specs if s.output == t) for t in out_ids]
    specs = _keras_order(specs, out_ids)
    inputs = tuple(InputSpec(*found[t], t) for t in sorted(found, reverse=True))
    return inputs, specs, _renumbered_outputs(specs, writers), tuple(o[0] for o in outs)


def _mask_op(layer: dict, raw: bool = False) -> tuple[str, list, dict]:
    """A mask operation's class, call arguments (tensors as ``keras_history`` triples, a list
    of tensors as a list of them; ``raw``: as written) and config (``Any``'s axis)."""
    nodes = layer.get("inbound_nodes") or []
    node = nodes[0] if len(nodes) == 1 and isinstance(nodes[0], dict) else {}
    where = f"operation {layer.get('name')!r} ({layer.get('class_name')})"

    def conv(a):
        if isinstance(a, list):
            return [conv(x) for x in a]
        return history(a, where)[0] if _holds_tensor(a) else a

    args = list(node.get("args") or [])
    return (
        str(layer.get("class_name")),
        args if raw else [conv(a) for a in args],
        dict(layer.get("config") or {}),
    )


def _input_ids(ins: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], int]:
    """Each model input's tensor: ``-k`` for input ``k`` (``input_layers`` order), so layer
    ``i`` keeps writing ``i + 1`` and a one-input model is numbered as it always was."""
    if len(set(ins)) != len(ins):
        raise InvalidSpec(f"model: input_layers={[list(e) for e in ins]} names an input twice")
    return {e: -k for k, e in enumerate(ins)}


def _output_ids(outs, tensors: dict, specs: list[LayerSpec]) -> list[int]:
    """The output tensors in ``output_layers`` order, refused where ringtrain cannot give each
    its own loss: an input as an output, one tensor named twice, an output another layer reads
    (its gradient would need the loss's and the reader's summed)."""
    ids = []
    for e in outs:
        if e not in tensors:
            raise InvalidSpec(f"model: output_layers names {list(e)}, which no layer writes")
        t = tensors[e]
        if t <= 0 or t in ids:
            raise InvalidSpec(
                f"model: output {e[0]!r} is "
                + ("a model input" if t <= 0 else "named twice")
                + " (supported: each output written by its own layer)"
            )
        if len(outs) > 1 and any(t in s.inputs for s in specs):
            readers = [s.name for s in specs if t in s.inputs]
            raise InvalidSpec(
                f"model: output {e[0]!r} is also read by {readers}: an output that other "
                "layers read is not supported in a model with several outputs"
            )
        ids.append(t)
    return ids


def _renumbered_outputs(specs: list[LayerSpec], writers: list[str]) -> tuple[int, ...]:
    """The output tensors after :func:`_keras_order`'s renumbering, found by their writers'
    names (which it keeps)."""
    return tuple(next(s.output for s in specs if s.name == n) for n in writers)


def _keras_order(specs: list[LayerSpec], outputs: list[int]) -> list[LayerSpec]:
    """The layers reachable from the output in Keras' own ``model.layers`` order (what
    ``get_weights()`` and ``model.weights.h5`` follow), tensors renumbered to match.

    Keras 3 (``ops/function.py`` ``map_graph``) walks depth-first from the output, numbering
    each layer at its first visit; a layer's depth is one more than its deepest reader's; layers
    are listed deepest first, ties by that number. A config Keras wrote is already in this
    order; a hand-written one is put in it, so an export loads with each weight in its place."""
    by_output = {s.output: s for s in specs}
    first: dict[int, int] = {}
    post: list[int] = []
    for output in outputs:  # Keras walks from each output in turn, sharing what it has seen
        first[output] = len(first)
        stack = [(output, iter(by_output[output].inputs))]
        while stack:  # depth-first, without recursion (a model may be thousands deep)
            t, rest = stack[-1]
            x = next((x for x in rest if x in by_output and x not in first), None)
            if x is None:
                post.append(t)
                stack.pop()
            else:
                first[x] = len(first)
                stack.append((x, iter(by_output[x].inputs)))
    depth: dict[int, int] = {}
    for t in reversed(post):
        d = depth.setdefault(t, 0)
        for x in by_output[t].inputs:
            if x in by_output:
                depth[x] = max(depth.get(x, 0), d + 1)
    order = sorted(post, key=lambda t: (-depth[t], first[t]))
    new = {t: t for s in specs for t in s.inputs if t <= 0}
    new.update({t: k + 1 for k, t in enumerate(order)})
    return [
        replace(by_output[t], inputs=tuple(new[x] for x in by_output[t].inputs), output=new[t])
        for t in order
    ]
