"""Parse a Keras ``Sequential`` or ``Functional`` config into a validated layer graph.

Pipeline position: the first step of ``--model`` / ``spec.trainer.model`` and of both
exporters. Input is what ``model.to_json()`` writes — Keras 3 (``module``, ``class_name``,
``config``, ``registered_name``, ``build_config``; a Functional node is ``{"args": [...],
"kwargs": {...}}`` whose tensors carry ``keras_history``) or tf.keras 2 (``batch_input_shape``;
a node is ``[[layer, node, tensor, kwargs], ...]``) — already decoded to a dict. Output is a
:class:`ModelConfig`: one :class:`LayerSpec` per layer with its input tensors, output tensor and
shapes, the loss and the compiled optimizer. Everything is checked here, *before anything
runs*, by shape arithmetic only (a 2 KB spec may describe a 40 GB model): an unsupported layer,
argument, value or graph feature raises :class:`InvalidSpec` naming it, so ``render``, ``run``,
the operator and ``ringtrain export`` refuse with the same words.

Tensors are small integers: the model's input is 0, and layer ``i`` (in topological order)
writes tensor ``i + 1`` — so a Sequential model is the chain every earlier tool expects.
Layers are built from the nodes as Keras' ``functional_from_config`` does: each once its inputs
exist. ``trainable=False`` on a layer with weights (or on the model) is refused: the trainer
trains every weight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import losses
from ringtrain_trainer.keras import compile as compile_mod
from ringtrain_trainer.keras import ops_numpy
from ringtrain_trainer.keras.entry import Args, Shape
from ringtrain_trainer.keras.registry import REGISTRY, SUPPORTED
from ringtrain_trainer.numerics import ModelNumerics
from ringtrain_trainer.optim.registry import OptimizerSpec

FUNCTIONAL = ("Functional", "Model")
_INPUT_ARGS = ("batch_shape", "batch_input_shape", "input_shape", "shape", "batch_size", "optional")


@dataclass(frozen=True)
class LayerSpec:
    """One Keras layer: class, name, its normalized arguments (the registry entry's parse),
    the tensors it reads and writes, and their per-example shapes."""

    cls: str
    name: str
    args: dict = field(hash=False)
    inputs: tuple[int, ...]
    output: int
    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    #: the source config's ``dtype`` entry as written (a DTypePolicy config, a name, or None),
    #: so an export records the user's dtype policy per layer (``archive.to_keras``)
    dtype: Any = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class InputSpec:
    """One model input: its InputLayer's name, per-example shape, dtype and tensor (``-k``
    for the ``k``-th of ``input_layers``)."""

    name: str
    shape: Shape
    dtype: str
    tensor: int


@dataclass(frozen=True)
class ModelConfig:
    """A validated model: its input (name, shape without the batch axis), layers in
    topological order, the output tensor, the loss that runs and the compiled optimizer."""

    name: str
    input_shape: Shape
    layers: tuple[LayerSpec, ...]
    from_logits: bool
    optimizer: OptimizerSpec | None = None
    #: the loss that runs (``engine.losses``): the compile settings', with any final softmax
    #: or sigmoid folded into it
    loss: losses.LossSpec = losses.DEFAULT
    functional: bool = False
    input_name: str = "input_layer"
    output: int = 0
    #: the InputLayer's dtype (``INPUT_DTYPES``)
    input_dtype: str = "float32"
    #: the dtype policy and loss scaling of the model (``keras.compile.numerics``)
    numerics: ModelNumerics = field(default_factory=ModelNumerics)
    #: every model input in ``input_layers`` order (the first is ``input_*`` above)
    inputs: tuple[InputSpec, ...] = ()
    #: every output tensor and its Keras name in ``output_layers`` order (the first is
    #: ``output``); several outputs compile an ``engine.multiloss.MultiLossSpec``
    outputs: tuple[int, ...] = ()
    output_names: tuple[str, ...] = ()

    @property
    def multi(self) -> bool:
        """Several inputs or several outputs: the packed data and loss (``engine.multiloss``)."""
        return len(self.inputs) > 1 or len(self.outputs) > 1

    def out_shape_of(self, tensor: int) -> Shape:
        return next(s.out_shape for s in self.layers if s.output == tensor)

    @property
    def ends_in_softmax(self) -> bool:
        return self.tail == "softmax"

    @property
    def tail(self) -> str | None:
        """The activation of the layer that writes the model's output."""
        last = next((s for s in self.layers if s.output == self.output), None)
        return None if last is None else REGISTRY[last.cls].activation(last.args)

    @property
    def output_shape(self) -> Shape:
        return next(s.out_shape for s in self.layers if s.output == self.output)

    def consumers(self, tensor: int) -> list[LayerSpec]:
        return [s for s in self.layers if tensor in s.inputs]


def _shape_of(cfg: dict) -> Shape | None:
    for key in ("batch_shape", "batch_input_shape"):
        if cfg.get(key) is not None:
            return tuple(cfg[key][1:])
    for key in ("input_shape", "shape"):
        if cfg.get(key) is not None:
            return tuple(cfg[key])
    return None


#: what a model's input may hold: floats, or integer ids (an Embedding's tokens; fed as float32
#: like every input, exact below 2**24)
INPUT_DTYPES = ("float32", "int32", "int64")


def _input_dtype(layer: dict) -> str:
    v = (layer.get("config") or {}).get("dtype") or "float32"
    if isinstance(v, dict):
        v = (v.get("config") or {}).get("name") or "float32"
    return str(v)


def _input_layer(layer: dict, index: int) -> tuple[str, Shape | None]:
    dtype = _input_dtype(layer)
    cfg = {k: v for k, v in (layer.get("config") or {}).items() if k != "dtype"}
    a = Args({**layer, "config": cfg}, index)
    if dtype not in INPUT_DTYPES:
        a.refuse("dtype", dtype, ", ".join(INPUT_DTYPES))
    shape = _shape_of(a.cfg)
    for k in (*_INPUT_ARGS, "sparse", "ragged", "input_tensor"):
        v = a.take(k)
        if k in ("sparse", "ragged", "input_tensor") and v:
            a.refuse(k, v, "False")
    a.done("shape")
    return a.name, shape


def _check_shape(shape: Any) -> Shape:
    if shape is None or any(not isinstance(d, int) or d < 1 for d in shape):
        raise InvalidSpec(
            f"model: the input shape {shape} must be known and fixed "
            "(give the model an InputLayer with shape=...)"
        )
    return tuple(shape)


def _unsupported(layer: Any, index: int) -> InvalidSpec:
    cls = layer.get("class_name") if isinstance(layer, dict) else None
    name = ((layer.get("config") or {}).get("name") if isinstance(layer, dict) else None) or index
    return InvalidSpec(
        f"model: layer {name!r} ({cls}) is not supported (supported layers: {', '.join(SUPPORTED)})"
    )


def _spec(
    layer: dict,
    index: int,
    inputs: tuple[int, ...],
    shapes: list[Shape],
    call: dict | None = None,
) -> LayerSpec:
    """Parse one layer's arguments through its entry and infer its output shape; ``call``:
    the Functional node's call arguments, read by the entry if it takes them (``call_args``)."""
    cls = layer.get("class_name")
    entry = REGISTRY.get(cls) if isinstance(cls, str) else None
    if entry is None:
        raise _unsupported(layer, index)
    a = Args(layer, index)
    for k, v in (call or {}).items():
        if k not in entry.call_args:
            supported = ", ".join(entry.call_args) or "none"
            raise InvalidSpec(
                f"model: {a.where}: call argument {k}={v!r} is not supported "
                f"(supported: {supported})"
            )
        a.cfg[k] = v
    for k in ("batch_input_shape", "input_shape", "batch_size"):
        a.take(k)
    args = {**entry.parse(a), **a.extra}
    n = len(inputs)
    if (entry.inputs and n != entry.inputs) or (not entry.inputs and n < 2):
        want = entry.inputs or "2 or more"
        raise InvalidSpec(f"model: {a.where}: called on {n} tensors (supported: {want})")
    try:
        out = tuple(entry.infer(args, shapes))
    except ValueError as e:
        raise InvalidSpec(f"model: {a.where}: {e}") from None
    dtype = copy.deepcopy((layer.get("config") or {}).get("dtype"))
    return LayerSpec(cls, a.name, args, inputs, index + 1, tuple(shapes), out, dtype)


def _sequential(cfg: dict) -> tuple[str, Shape, list[LayerSpec], int]:
    layers = cfg.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidSpec("model: the Sequential config has no layers")
    shape = tuple(cfg["build_input_shape"][1:]) if cfg.get("build_input_shape") else None
    in_name, specs = "input_layer", []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise _unsupported(layer, i)
        if layer.get("class_name") == "InputLayer":
            in_name, got = _input_layer(layer, i)
            shape = got or shape
            continue
        if not specs and shape is None:
            shape = _shape_of(layer.get("config") or {})
        if not specs:
            shape = _check_shape(shape)
        t = len(specs)
        specs.append(_spec(layer, t, (t,), [specs[-1].out_shape if specs else shape]))
    return in_name, _check_shape(shape), specs, len(specs)


def _history(v: Any, where: str) -> list[tuple[str, int, int]]:
    """Every ``keras_history`` in a Keras 3 node's args, in order, however nested."""
    if isinstance(v, dict):
        if v.get("class_name") == "__keras_tensor__":
            h = (v.get("config") or {}).get("keras_history")
            if not isinstance(h, list) or len(h) != 3:
                raise InvalidSpec(f"model: {where}: a tensor without keras_history")
            return [(str(h[0]), int(h[1]), int(h[2]))]
        return [t for x in v.values() for t in _history(x, where)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _history(x, where)]
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
            "(supported: each layer called once)"
        )
    node = nodes[0]
    if isinstance(node, dict):  # Keras 3
        kwargs = {}
        for k, v in (node.get("kwargs") or {}).items():
            if _holds_tensor(v):
                raise InvalidSpec(
                    f"model: {where}: call argument {k} is a tensor (supported: none)"
                )
            if v not in (None, False):
                kwargs[k] = v
        return _history(node.get("args") or [], where), kwargs
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


def _functional(cfg: dict) -> tuple[str, Shape, list[LayerSpec], int]:
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
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise _unsupported(layer, i)
        if ops_numpy.is_operation(layer):  # ``x + 3.0`` on Keras tensors
            layer = ops_numpy.as_layer(layer)
        name = str(layer.get("name") or (layer.get("config") or {}).get("name") or i)
        if layer.get("class_name") == "InputLayer":
            if (name, 0, 0) not in in_ids:
                raise InvalidSpec(f"model: InputLayer {name!r} is not one of the model's inputs")
            t = in_ids[(name, 0, 0)]
            shape = _check_shape(_input_layer(layer, i)[1])
            tensors[(name, 0, 0)], shapes[t] = t, shape
            found[t] = (name, shape, _input_dtype(layer))
        elif layer.get("inbound_nodes"):  # a layer never called is not part of the model
            where = f"layer {name!r} ({layer.get('class_name')})"
            pending.append((layer, name, *_node_inputs(layer, where)))
    for (in_name, _, _), t in in_ids.items():
        if t not in found:
            raise InvalidSpec(f"model: input_layers names {in_name!r}, which is no InputLayer")
    specs: list[LayerSpec] = []
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
        s = _spec(layer, len(specs), t_in, [shapes[t] for t in t_in], call)
        specs.append(s)
        tensors[(name, 0, 0)], shapes[s.output] = s.output, s.out_shape
    out_ids = _output_ids(outs, tensors, specs)
    writers = [next(s.name for s in specs if s.output == t) for t in out_ids]
    specs = _keras_order(specs, out_ids)
    inputs = tuple(InputSpec(*found[t], t) for t in sorted(found, reverse=True))
    return inputs, specs, _renumbered_outputs(specs, writers), tuple(o[0] for o in outs)


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


def parse(model: dict, compiled: bool = True) -> ModelConfig:
    """Validate a Keras Sequential or Functional config (Keras 3 or tf.keras 2 ``to_json``).
    ``compiled`` False (the exporters, which copy ``compile_config`` as it is): the layers
    only, with the default loss."""
    cls = model.get("class_name") if isinstance(model, dict) else type(model).__name__
    if cls not in ("Sequential", *FUNCTIONAL):
        raise InvalidSpec(
            f"model: a Keras Sequential or Functional config is needed, got {cls!r} "
            "(subclassed models are not supported)"
        )
    cfg = model.get("config") or {}
    if cfg.get("trainable", True) is not True:
        raise InvalidSpec(
            f"model: trainable={cfg['trainable']!r} is not supported "
            "(supported: True: ringtrain trains every layer's weights)"
        )
    functional = cls != "Sequential"
    if functional:
        inputs, specs, outputs, out_names = _functional(cfg)
    else:
        in_name, shape, specs, output = _sequential(cfg)
        first = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
        first = [x for x in first if x.get("class_name") == "InputLayer"]
        dtype = _input_dtype(first[0]) if first else "float32"
        inputs, outputs = (InputSpec(in_name, shape, dtype, 0),), (output,)
        out_names = (specs[-1].name,) if specs else ()
    if not specs or outputs[0] <= 0:
        raise InvalidSpec("model: the config has no layer with weights or computation")
    tails = [next(s for s in specs if s.output == t) for t in outputs]
    acts = [REGISTRY[t.cls].activation(t.args) for t in tails]
    comp = model.get("compile_config")
    if not compiled:
        loss, optimizer = losses.DEFAULT, None
    elif len(outputs) > 1:
        widths = [t.out_shape[-1] if t.out_shape else 1 for t in tails]
        loss, optimizer = compile_mod.read_heads(comp, acts, list(out_names), widths)
    else:
        loss, optimizer = compile_mod.read(comp, acts[0])
    return ModelConfig(
        str(cfg.get("name") or ("functional" if functional else "sequential")),
        inputs[0].shape,
        tuple(specs),
        bool(loss.arg("from_logits")),
        optimizer,
        loss,
        functional,
        inputs[0].name,
        outputs[0],
        inputs[0].dtype,
        compile_mod.numerics(model) if compiled else ModelNumerics(),
        inputs,
        tuple(outputs),
        tuple(out_names),
    )
