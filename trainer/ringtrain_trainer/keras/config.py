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

Tensors are small integers: the model's inputs are 0, -1, -2 … (``input_layers`` order), and
layer ``i`` (in topological order) writes tensor ``i + 1`` — so a Sequential model is the chain
every earlier tool expects. A Functional config's graph is read by :mod:`.functional`; nested
models and shared layers are first rewritten into one flat graph (:mod:`.nested`,
:mod:`.shared`). ``trainable=False`` on the whole model is refused: there would be nothing to
train.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import loss_spec
from ringtrain_trainer.keras import compile as compile_mod
from ringtrain_trainer.keras import masks, nested, shared
from ringtrain_trainer.keras.entry import Shape
from ringtrain_trainer.keras.functional import read_graph
from ringtrain_trainer.keras.layer_spec import (
    FUNCTIONAL,
    InputSpec,
    LayerSpec,
    check_shape,
    input_dtype,
    input_layer,
    make_spec,
    shape_of,
    unsupported,
)
from ringtrain_trainer.keras.registry import REGISTRY
from ringtrain_trainer.optim.numerics import ModelNumerics
from ringtrain_trainer.optim.registry import OptimizerSpec


@dataclass(frozen=True)
class ModelConfig:
    """A validated model: its input (name, shape without the batch axis), layers in
    topological order, the output tensor, the loss that runs and the compiled optimizer."""

    name: str
    input_shape: Shape
    layers: tuple[LayerSpec, ...]
    from_logits: bool
    optimizer: OptimizerSpec | None = None
    #: the loss that runs (``engine.loss_spec``): the compile settings', with any final softmax
    #: or sigmoid folded into it
    loss: loss_spec.LossSpec = loss_spec.DEFAULT
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
    #: every model input in ``input_layers`` order (the first is ``input_*`` above)
    inputs: tuple[InputSpec, ...] = ()
    #: every output tensor and its Keras name in ``output_layers`` order (the first is
    #: ``output``); several outputs compile an ``engine.multiloss.MultiLossSpec``
    outputs: tuple[int, ...] = ()
    output_names: tuple[str, ...] = ()
    #: the source's ``compile_config`` ``metrics`` and ``weighted_metrics`` as written, so an
    #: export compiles with them again (Keras' ``evaluate`` then reports every one)
    compiled_metrics: dict = field(default_factory=dict, hash=False, compare=False)

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


def free_input_shape(model: dict) -> Shape | None:
    """The model's declared per-example input shape where it has a free (None) dimension
    (``keras.Input(shape=(None,))``), else None."""
    cfg = (model.get("config") or {}) if isinstance(model, dict) else {}
    layers = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
    first = [x for x in layers if x.get("class_name") == "InputLayer"]
    if len(first) > 1:  # several inputs: each fixed in its InputLayer (``check_shape``)
        return None
    shape = shape_of(first[0].get("config") or {}) if first else None
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


def _sequential(cfg: dict) -> tuple[str, Shape, list[LayerSpec], int]:
    layers = cfg.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidSpec("model: the Sequential config has no layers")
    shape = tuple(cfg["build_input_shape"][1:]) if cfg.get("build_input_shape") else None
    in_name, specs = "input_layer", list[LayerSpec]()
    first: Shape = ()
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise unsupported(layer, i)
        if layer.get("class_name") == "InputLayer":
            in_name, got = input_layer(layer, i)
            shape = got or shape
            continue
        if not specs and shape is None:
            shape = shape_of(layer.get("config") or {})
        if not specs:
            first = check_shape(shape)
        t = len(specs)
        specs.append(make_spec(layer, t, (t,), [specs[-1].out_shape if specs else first]))
    return in_name, check_shape(shape), specs, len(specs)


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
    if functional:
        inputs, specs, outputs, out_names = read_graph(cfg)
    else:
        in_name, shape, specs, output = _sequential(cfg)
        first = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
        first = [x for x in first if x.get("class_name") == "InputLayer"]
        dtype = input_dtype(first[0]) if first else "float32"
        inputs, outputs = (InputSpec(in_name, shape, dtype, 0),), (output,)
        out_names = (specs[-1].name,) if specs else ()
    specs = [replace(s, shares=copies[s.name]) if s.name in copies else s for s in specs]
    if not specs or outputs[0] <= 0:
        raise InvalidSpec("model: the config has no layer with weights or computation")
    masks.propagate(specs, tuple(outputs))  # a mask no layer can honour is refused, by name
    tails = [next(s for s in specs if s.output == t) for t in outputs]
    acts = [REGISTRY[t.cls].activation(t.args) for t in tails]
    comp = model.get("compile_config")
    if not compiled:
        loss, optimizer = loss_spec.DEFAULT, None
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
        nesting,
        _metrics(model, loss) if compiled and len(outputs) == 1 else (),
        inputs,
        tuple(outputs),
        tuple(out_names),
        {
            k: copy.deepcopy((comp or {}).get(k))
            for k in ("metrics", "weighted_metrics")
            if compiled
        },
    )


def _metrics(model: dict, loss: loss_spec.LossSpec) -> tuple:
    """A one-output model's compiled metrics (several outputs: ``compile.read_heads``)."""
    comp = model.get("compile_config") or {}
    return compile_mod.compiled_metrics(comp.get("metrics"), loss.kind)
