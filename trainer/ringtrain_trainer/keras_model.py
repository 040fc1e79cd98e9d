"""From a Keras model (preset, ``model.to_json()`` file, ``.keras`` archive) to IPU ops, and
back.

Pipeline position: ``--model`` → :func:`load` → :class:`KerasModel`, a ``model.ModelSpec`` the
IPU compiles like any other. The layers come from ``keras.config.parse`` (everything refused
there, before anything runs); each is built into an engine op by its registry entry
(``keras/registry.py``) and wired into the engine's ``Graph`` as the config wires it. Passes over
that graph, each keeping the numbers of the unfused ops:

* ``Conv2D`` (square kernel, 'valid', stride 1, ReLU, bias) whose only reader is a
  ``MaxPooling2D(2)`` becomes ``layers.fused.ConvPool``, the fused kernel the seeds' CNN uses;
* a ``Reshape``/``Flatten`` reading the model's input alone becomes the program's input shape,
  and a flattening whose only reader is a ``Dense`` disappears (Dense flattens its input
  itself) — so the presets keep today's layer indices, parameter layout, numbers and speed;
* a final softmax (categorical losses) or sigmoid (binary cross-entropy) is folded into the
  loss, as Keras itself does: its TensorFlow backend computes the cross-entropy from the
  activation's input. The IPU's last op then outputs logits (``engine.losses``).

Going back, :meth:`KerasModel.keras_config` writes a Keras 3 config of the same kind and
:meth:`KerasModel.keras_weights` the arrays in ``model.get_weights()`` order.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import budget as budget_mod
from ringtrain_trainer.engine.graph import Graph, Node
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.keras import archive
from ringtrain_trainer.keras.config import LayerSpec, ModelConfig, parse
from ringtrain_trainer.keras.entry import Build
from ringtrain_trainer.keras.registry import REGISTRY
from ringtrain_trainer.model import ModelSpec, Slot

PRESETS = ("cnn", "cnn2")


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


def _weight_arg(weight: str) -> str:
    """The Keras argument prefix that initializes/regularizes a weight (``query_kernel`` and
    ``kernel`` ← ``kernel_*``, ``recurrent_kernel`` ← ``recurrent_*``)."""
    for kind in ("recurrent", "depthwise", "pointwise"):
        if weight.endswith(f"{kind}_kernel"):
            return kind
    for kind in ("kernel", "bias"):
        if weight == kind or weight.endswith(f"_{kind}"):
            return kind
    return weight


def _with_weight_args(slots: list[Slot], layers: list[LayerSpec], owner) -> list[Slot]:
    """The slots with each parameter's non-default initializer and regularizer (the layer's
    ``*_initializer``/``*_regularizer`` arguments, kept by ``Args``); one that names no
    trainable weight of its layer is refused rather than ignored."""
    from ringtrain_trainer.engine.ops import initializers, regularizers

    extra: dict[tuple[int, str], dict] = {}
    readers = {"init": initializers.parse, "reg": regularizers.parse}
    for s, li in zip(layers, owner, strict=True):
        used: set[str] = set()
        entry = REGISTRY[s.cls]
        for w in entry.weights(s.args, list(s.in_shapes)):
            args, own = entry.weight_args(s.args, w.name)
            for field, suffix in (("init", "initializer"), ("reg", "regularizer")):
                arg = f"{_weight_arg(own)}_{suffix}"
                if arg in args and w.trainable and li is not None:
                    used.add(arg)
                    extra.setdefault((li, w.name), {})[field] = readers[field](args[arg], arg)
        for k in s.args:
            optional = k.split("_")[0] in ("bias", "gamma", "beta")  # absent when switched off
            if k.endswith(("_initializer", "_regularizer")) and k not in used and not optional:
                raise InvalidSpec(
                    f"model: layer {s.name!r} ({s.cls}): {k}={s.args[k]!r} is not supported "
                    "(supported: Keras' default; no trainable weight of this layer takes it)"
                )
    return [
        Slot(replace(x.spec, **extra[(x.spec.layer, x.spec.name)]), x.start, x.stop)
        if (x.spec.layer, x.spec.name) in extra
        else x
        for x in slots
    ]


def _heads(config: ModelConfig) -> dict[int, str | None]:
    """Each output tensor → the activation its loss folds away (None: none)."""
    loss = config.loss
    if not isinstance(loss, MultiLossSpec):
        return {config.output: loss.folded}
    return {
        t: h.loss.folded if h.loss else None
        for t, h in zip(config.outputs, loss.heads, strict=True)
    }


def _output_width(config: ModelConfig, ops: list, where: dict[int, int], t: int) -> int:
    """An output's units; refused unless flat (and ≥ 2 classes for a classifier)."""
    shape = tuple(ops[where[t] - 1].out_shape) if where[t] > 0 else ()
    loss = config.loss
    name = None
    if isinstance(loss, MultiLossSpec):
        k = config.outputs.index(t)
        name, loss = config.output_names[k], loss.heads[k].loss
    kind = loss.kind if loss is not None else "regression"
    if len(shape) != 1 or (shape[0] < 2 and kind in ("sparse", "categorical")):
        what = f"the output {name!r}'s shape" if name else "the output shape"
        raise InvalidSpec(
            f"model: {what} is {shape}; "
            + (
                "a classifier needs one score per class (end with Dense(num_classes))"
                if kind in ("sparse", "categorical")
                else f"{getattr(loss, 'name', 'an output')} needs a flat output "
                "(end with Dense(units))"
            )
        )
    return shape[0]


class KerasModel(ModelSpec):
    """A :class:`ModelSpec` built from a Keras config, which it remembers."""

    def __init__(self, name: str, config: ModelConfig, initial=None):
        from ringtrain_trainer.layers.fused import ConvPool

        self.config = config
        #: the model's mixed-precision settings (``ringtrain_trainer.numerics``)
        self.numerics = config.numerics
        self.loss_from_logits = True  # the IPU's loss always reads logits (see module doc)
        specs = config.layers
        ops: list = []
        nodes: list[Node] = []
        #: Keras tensor → the IPU tensor holding it
        where: dict[int, int] = {x.tensor: x.tensor for x in config.inputs} or {0: 0}
        heads = _heads(config)
        ipu_input = config.input_shape
        #: per Keras layer: the IPU op holding its weights (None: folded away)
        owner: list[int | None] = [None] * len(specs)
        done: set[int] = set()
        for i, s in enumerate(specs):
            if i in done:
                continue
            readers = config.consumers(s.output)
            last = s.output in heads
            if s.cls in ("Reshape", "Flatten") and (
                (
                    not ops
                    and s.inputs == (0,)
                    and len(config.consumers(0)) == 1
                    and len(config.inputs) <= 1
                )
                or (
                    len(s.out_shape) == 1
                    and len(readers) == 1
                    and readers[0].cls == "Dense"
                    and not last
                )
            ):
                if not ops:
                    ipu_input = s.out_shape
                where[s.output] = where[s.inputs[0]]
                continue
            group = [s]
            if _fuses(s, readers) and not last:
                group.append(readers[0])
                done.add(specs.index(readers[0]))
                op = ConvPool(tuple(s.in_shapes[0]), s.args["filters"], s.args["kernel_size"][0])
            else:
                fold = heads[s.output] if last else None
                try:
                    op = REGISTRY[s.cls].build(s, list(s.in_shapes), Build(i, fold))
                except ValueError as e:
                    raise InvalidSpec(f"model: layer {s.name!r} ({s.cls}): {e}") from None
            if op is None:  # the identity (an activation folded into the loss)
                where[s.output] = where[s.inputs[0]]
                continue
            op.name = "+".join(x.name for x in group)
            n = len(ops)
            nodes.append(Node(n, tuple(where[t] for t in s.inputs), n + 1))
            ops.append(op)
            for g in group:
                where[g.output] = n + 1
            owner[i] = n
        self.owner = owner
        if not ops:
            raise InvalidSpec("model: the config has no layer with weights or computation")
        outs = config.outputs or (config.output,)
        widths = [_output_width(config, ops, where, t) for t in outs]
        ins = config.inputs
        graph = Graph(nodes, tuple(x.tensor for x in ins) or (0,), tuple(where[t] for t in outs))
        #: several inputs: each one's own shape; the program's ``x`` packs them row-major
        self.graph_input_shapes = [tuple(x.shape) for x in ins] if len(ins) > 1 else None
        if self.graph_input_shapes:
            ipu_input = (sum(math.prod(x.shape) for x in ins),)
        #: the IPU program's input shape: the Keras input after any leading Reshape/Flatten
        #: (same bytes, row-major); ``config.input_shape`` is what the Keras model takes
        super().__init__(name, ops, tuple(ipu_input), sum(widths), graph=graph, loss=config.loss)
        self.slots = _with_weight_args(self.slots, config.layers, owner)
        self.initial = initial  # (flat, state) from a .keras archive, or None

    def init(self, seed: int, dtype=np.float32) -> np.ndarray:
        if self.initial is not None:
            return self.initial[0].astype(dtype)
        return super().init(seed, dtype)

    def init_state(self, dtype=np.float32) -> np.ndarray:
        if self.initial is not None:
            return self.initial[1].astype(dtype)
        return super().init_state(dtype)

    # -- back to Keras -------------------------------------------------------------------
    def keras_config(self, precision: str | None = None) -> dict:
        """A Keras 3 config (``model.to_json()`` shape, Sequential or Functional as the
        source) that Keras loads, compiled with the loss that ran; ``precision``: the run's,
        for the layers' dtype policies (``archive.layer_dtype``)."""
        return archive.to_keras(
            self.config,
            {
                "optimizer": "adam",
                "loss": self.config.loss.keras(),
                "metrics": None,
                "loss_weights": (
                    self.config.loss.keras_weights()
                    if isinstance(self.config.loss, MultiLossSpec)
                    else None
                ),
                "weighted_metrics": None,
                "run_eagerly": False,
                "steps_per_execution": 1,
                "jit_compile": False,
            },
            precision,
        )

    def _weight_refs(self):
        """(keras layer, weight name, where, ipu op) in get_weights order; where is "p"
        (trainable, the flat buffer) or "s" (state)."""
        for s, li in zip(self.config.layers, self.owner, strict=True):
            for w in REGISTRY[s.cls].weights(s.args, list(s.in_shapes)):
                yield s, w.name, "p" if w.trainable else "s", li

    def keras_weights(
        self, flat_params: np.ndarray, state: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """Arrays in ``model.get_weights()`` order (kernel HWIO / (in, out) as Keras)."""
        state = self.init_state() if state is None else state
        pv, sv = self.views(flat_params), self.state_views(state)
        shapes = [w.shape for s in self.config.layers for w in archive.weights_of_layer(s)]
        return [
            np.array((pv if w == "p" else sv)[li][n], np.float32).reshape(shape)
            for (_, n, w, li), shape in zip(self._weight_refs(), shapes, strict=True)
        ]

    def from_keras_weights(self, weights: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The inverse of :meth:`keras_weights`: (flat parameters, state)."""
        flat = np.zeros(self.num_params, np.float32)
        state = self.init_state()
        pv, sv = self.views(flat), self.state_views(state)
        refs = list(self._weight_refs())
        if len(weights) != len(refs):
            raise InvalidSpec(
                f"model {self.name!r}: {len(weights)} weight arrays for {len(refs)} expected"
            )
        for (s, n, w, li), arr in zip(refs, weights, strict=True):
            dst = (pv if w == "p" else sv)[li][n]
            if np.shape(arr) != dst.shape and (np.shape(arr), dst.shape) != ((), (1,)):
                raise InvalidSpec(
                    f"model {self.name!r}: layer {s.name!r} weight {n} has "
                    f"shape {np.shape(arr)}, the config needs {dst.shape}"
                )
            dst[...] = arr
        return flat, state

    def h5_groups(self) -> list[tuple[LayerSpec, str | None]]:
        """Each Keras layer with its ``model.weights.h5`` group (``keras.archive``)."""
        return list(zip(self.config.layers, archive.h5_paths(self.config), strict=True))


def from_config(
    model: dict, name: str = "keras", budget: tuple[int, int] | None = None
) -> KerasModel:
    """A :class:`KerasModel` from a decoded ``model.to_json()`` dict (either Keras format).
    ``budget`` (one IPU's bytes, examples per IPU): refuse a model that cannot fit it by
    arithmetic (``budget.check``) before building anything proportional to its size."""
    config = parse(model)
    if budget is not None:
        budget_mod.check(config, *budget)
    return KerasModel(name, config)


def preset_config(name: str) -> dict:
    text = resources.files("ringtrain_trainer").joinpath(f"presets/{name}.json").read_text()
    return json.loads(text)


def read_keras_archive(
    path: Path, budget: tuple[int, int] | None = None
) -> tuple[dict, list[np.ndarray], KerasModel]:
    """config, weights in ``get_weights`` order, and the model, from a ``.keras`` zip."""
    config, weights = archive.read_keras(path)
    return config, weights, from_config(config, str(path), budget)


def describe(source: str) -> str:
    """``--model``'s value for a log line: an inline config by its name, not its whole text."""
    if not source.lstrip().startswith("{"):
        return repr(source)
    try:
        name = (json.loads(source).get("config") or {}).get("name")
    except (ValueError, AttributeError):
        name = None
    return f"inline Keras config {name or 'sequential'!r}"


def load(source: str, budget: tuple[int, int] | None = None) -> KerasModel:
    """``--model``: a preset name, a ``.json`` file of ``model.to_json()``, a ``.keras``
    file whose weights become the starting point, or ``model.to_json()``'s text itself (how the
    operator passes ``spec.trainer.model`` written inline; a checkpoint records it the same way,
    so ``ringtrain export`` rebuilds the model from the checkpoint alone). ``budget``: see
    :func:`from_config`."""
    if source in PRESETS:
        return from_config(preset_config(source), source, budget)
    if source.lstrip().startswith("{"):
        try:
            config = json.loads(source)
        except ValueError as e:
            raise InvalidSpec(f"--model: inline Keras config is not JSON ({e})") from None
        return from_config(config, "inline", budget)
    path = Path(source)
    if path.suffix == ".keras" and path.is_file():
        _, weights, spec = read_keras_archive(path, budget)
        spec.initial = spec.from_keras_weights(weights)
        return spec
    if path.suffix == ".json" and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidSpec(f"--model {source}: cannot read a Keras config ({e})") from None
        return from_config(config, source, budget)
    raise InvalidSpec(
        f"--model: unknown model {source!r} (known: {', '.join(PRESETS)}; "
        "or a path to a .json file of model.to_json() or a .keras file, or "
        "model.to_json()'s text)"
    )
