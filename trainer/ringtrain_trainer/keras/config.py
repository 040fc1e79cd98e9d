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
from ringtrain_trainer.keras import masks, nested, ops_numpy, shared
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
    #: a later call of a shared layer (``keras.shared``): the layer whose weights it uses
    shares: str | None = None


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
    #: the nested models flattened into this one (``keras.nested``), for the export
    nesting: nested.Nesting = field(default_factory=nested.Nesting)
    #: the compiled metrics beyond the loss's own (``keras.compile.compiled_metrics``)
    metrics: tuple = ()

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


def free_input_shape(model: dict) -> Shape | None:
    """The model's declared per-example input shape where it has a free (None) dimension
    (``keras.Input(shape=(None,))``), else None."""
    cfg = (model.get("config") or {}) if isinstance(model, dict) else {}
    layers = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
    first = [x for x in layers if x.get("class_name") == "InputLayer"]
    shape = _shape_of(first[0].get("config") or {}) if first else None
    if shape is None and cfg.get("build_input_shape"):
        shape = tuple(cfg["build_input_shape"][1:])
    return shape if shape is not None and None in shape else None


def fix_input_shape(model: dict, data: Shape) -> dict:
    """The model with each free input dimension fixed to the data's (``data``: one example's
    shape, the ``.npz``'s ``x``), as Poplar compiles a static graph; a copy, the model's own
    config untouched (the export keeps its None dims). Refused by name where the data cannot
    fill it: another rank, or a fixed dimension that differs."""
    declared = free_input_shape(model)
    if declared is None:
        return model
    data = tuple(int(d) for d in data)
    if len(data) != len(declared) or any(
        d is not None and d != x for d, x in zip(declared, data, strict=True)
    ):
        raise InvalidSpec(
            f"model: the input shape {declared} has free (None) dimensions, but the data's "
            f"examples are {data}: the data must fill the None dimensions and match the others"
        )
    out = copy.deepcopy(model)
    cfg = out["config"]
    for layer in cfg.get("layers") or []:
        if isinstance(layer, dict) and layer.get("class_name") == "InputLayer":
            lc = layer.setdefault("config", {})
            for key in ("batch_shape", "batch_input_shape"):
                if lc.get(key) is not None:
                    lc[key] = [lc[key][0], *data]
            for key in ("input_shape", "shape"):
                if lc.get(key) is not None:
                    lc[key] = list(data)
            break
    if cfg.get("build_input_shape"):
        cfg["build_input_shape"] = [cfg["build_input_shape"][0], *data]
    return out


def _check_shape(shape: Any) -> Shape:
    if shape is None or any(not isinstance(d, int) or d < 1 for d in shape):
        raise InvalidSpec(
            f"model: the input shape {shape} must be known and fixed "
            "(give the model an InputLayer with shape=..., or train it on data whose x "
            "fixes its None dimensions)"
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
            "(supported: each layer called once in a tf.keras 2 config; a Keras 3 config may "
            "share layers)"
        )
    node = nodes[0]
    if isinstance(node, dict):  # Keras 3
        kwargs = {}
        for k, v in (node.get("kwargs") or {}).items():
            if k == "mask" and _holds_tensor(v):  # a spelled-out Keras mask: keras.masks
                kwargs[k] = tuple(_history(v, where))
                continue
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
    for what, ends in (("inputs", ins), ("outputs", outs)):
        if len(ends) != 1:
            names = ", ".join(repr(e[0]) for e in ends)
            raise InvalidSpec(
                f"model: {len(ends)} {what} ({names}): a model with several {what} is not "
                f"supported (supported: one input and one output)"
            )
    tensors: dict[tuple[str, int, int], int] = {}
    shapes: dict[int, Shape] = {}
    in_name, shape = ins[0][0], None
    pending = []
    mask_ops: dict[tuple[str, int, int], tuple[str, list, dict]] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise _unsupported(layer, i)
        if ops_numpy.is_operation(layer) and masks.is_mask_op(*_mask_op(layer, raw=True)):
            mask_ops[(str(layer.get("name")), 0, 0)] = _mask_op(layer)
            continue
        if ops_numpy.is_operation(layer):  # ``x + 3.0`` on Keras tensors
            layer = ops_numpy.as_layer(layer)
        name = str(layer.get("name") or (layer.get("config") or {}).get("name") or i)
        if layer.get("class_name") == "InputLayer":
            if name != in_name:
                raise InvalidSpec(f"model: InputLayer {name!r} is not the model's input")
            shape = _check_shape(_input_layer(layer, i)[1])
            tensors[(name, 0, 0)], shapes[0] = 0, shape
        elif layer.get("inbound_nodes"):  # a layer never called is not part of the model
            where = f"layer {name!r} ({layer.get('class_name')})"
            pending.append((layer, name, *_node_inputs(layer, where)))
    if shape is None:
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
        s = _spec(layer, len(specs), t_in, [shapes[t] for t in t_in], call)
        specs.append(s)
        if mask is not None:
            spelled.append((s, mask, f"layer {name!r} ({s.cls})"))
        tensors[(name, 0, 0)], shapes[s.output] = s.output, s.out_shape
    if outs[0] not in tensors:
        raise InvalidSpec(f"model: output_layers names {list(outs[0])}, which no layer writes")
    derived = masks.propagate(specs, tensors[outs[0]])
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
    specs = _keras_order(specs, tensors[outs[0]])
    return in_name, shape, specs, len(specs)


def _mask_op(layer: dict, raw: bool = False) -> tuple[str, list, dict]:
    """A mask operation's class, call arguments (tensors as ``keras_history`` triples, a list
    of tensors as a list of them; ``raw``: as written) and config (``Any``'s axis)."""
    nodes = layer.get("inbound_nodes") or []
    node = nodes[0] if len(nodes) == 1 and isinstance(nodes[0], dict) else {}
    where = f"operation {layer.get('name')!r} ({layer.get('class_name')})"

    def conv(a):
        if isinstance(a, list):
            return [conv(x) for x in a]
        return _history(a, where)[0] if _holds_tensor(a) else a

    args = list(node.get("args") or [])
    return (
        str(layer.get("class_name")),
        args if raw else [conv(a) for a in args],
        dict(layer.get("config") or {}),
    )


def _keras_order(specs: list[LayerSpec], output: int) -> list[LayerSpec]:
    """The layers reachable from the output in Keras' own ``model.layers`` order (what
    ``get_weights()`` and ``model.weights.h5`` follow), tensors renumbered to match.

    Keras 3 (``ops/function.py`` ``map_graph``) walks depth-first from the output, numbering
    each layer at its first visit; a layer's depth is one more than its deepest reader's; layers
    are listed deepest first, ties by that number. A config Keras wrote is already in this
    order; a hand-written one is put in it, so an export loads with each weight in its place."""
    by_output = {s.output: s for s in specs}
    first: dict[int, int] = {output: 0}
    post: list[int] = []
    stack = [(output, iter(by_output[output].inputs))]
    while stack:  # depth-first, without recursion (a model may be thousands of layers deep)
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
    new = {0: 0, **{t: k + 1 for k, t in enumerate(order)}}
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
    model, nesting = nested.flatten(model)
    model, copies = shared.expand(model)
    cls = model.get("class_name")
    cfg = model.get("config") or {}
    if cfg.get("trainable", True) is not True:
        raise InvalidSpec(
            f"model: trainable={cfg['trainable']!r} is not supported "
            "(supported: True: ringtrain trains every layer's weights)"
        )
    functional = cls != "Sequential"
    in_name, shape, specs, output = (_functional if functional else _sequential)(cfg)
    specs = [replace(s, shares=copies[s.name]) if s.name in copies else s for s in specs]
    if not specs or output == 0:
        raise InvalidSpec("model: the config has no layer with weights or computation")
    masks.propagate(specs, output)  # a mask no layer can honour is refused here, by name
    tail = next(s for s in specs if s.output == output)
    first = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
    first = [x for x in first if x.get("class_name") == "InputLayer"]
    dtype = _input_dtype(first[0]) if first else "float32"
    loss, optimizer = (
        compile_mod.read(model.get("compile_config"), REGISTRY[tail.cls].activation(tail.args))
        if compiled
        else (losses.DEFAULT, None)
    )
    return ModelConfig(
        str(cfg.get("name") or ("functional" if functional else "sequential")),
        shape,
        tuple(specs),
        bool(loss.arg("from_logits")),
        optimizer,
        loss,
        functional,
        in_name,
        output,
        dtype,
        compile_mod.numerics(model) if compiled else ModelNumerics(),
        nesting,
        _metrics(model, loss) if compiled else (),
    )


def _metrics(model: dict, loss: losses.LossSpec) -> tuple:
    comp = model.get("compile_config") or {}
    return compile_mod.compiled_metrics(comp.get("metrics"), loss.kind)
