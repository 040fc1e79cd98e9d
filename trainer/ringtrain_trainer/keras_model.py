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

import dataclasses
import json
import math
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import budget as budget_mod
from ringtrain_trainer.engine.graph import Graph, Node
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.keras import archive, outputs, shared, weight_args
from ringtrain_trainer.keras.config import (
    LayerSpec,
    ModelConfig,
    fix_input_shape,
    free_input_shape,
    parse,
)
from ringtrain_trainer.keras.entry import Build, without_folded
from ringtrain_trainer.keras.mask_nodes import MaskWiring
from ringtrain_trainer.keras.registry import REGISTRY
from ringtrain_trainer.model import ModelSpec

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


#: Dropout draws are keyed by layer index; an RNN's input dropout uses its index plus this
RNN_DROPOUT_KEY = 1 << 20


def _input_dropout(s: LayerSpec, i: int, ops: list, nodes: list[Node], src: int) -> int:
    """An RNN's ``dropout`` as Keras 3 runs it without ``recurrent_dropout``: one mask per
    sequence over the input features, the same at every step (``LSTM.call`` draws it from
    the first step), scaled by ``1 / (1 - rate)``: a shared-mask Dropout node before the RNN,
    the identity outside training."""
    from ringtrain_trainer.engine.ops.dropout import SharedDropout

    shape = tuple(s.in_shapes[0])
    op = SharedDropout(shape, s.args["dropout"], RNN_DROPOUT_KEY + i, (1, shape[-1]))
    op.name = f"{s.name}/input_dropout"
    n = len(ops)
    nodes.append(Node(n, (src,), n + 1))
    ops.append(op)
    return n + 1


class KerasModel(ModelSpec):
    """A :class:`ModelSpec` built from a Keras config, which it remembers."""

    def __init__(self, name: str, config: ModelConfig, initial=None):
        from ringtrain_trainer.layers.fused import ConvPool

        self.config = config
        #: the input shape the source declared where it has None dims (fixed from the data)
        self.declared_input_shape: tuple | None = None
        #: the model's mixed-precision settings (``ringtrain_trainer.numerics``)
        self.numerics = config.numerics
        self.loss_from_logits = True  # the IPU's loss always reads logits (see module doc)
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
            if (
                reg is None
                and s.cls in ("Reshape", "Flatten")
                and (
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
                )
            ):
                if not ops:
                    ipu_input = s.out_shape
                where[s.output] = where[s.inputs[0]]
                continue
            group = [s]
            roles, extra = wiring.inputs(s)
            if (
                reg is None
                and _fuses(s, readers)
                and not last
                and (s.shares or s.name) not in calls
            ):
                group.append(readers[0])
                done.add(specs.index(readers[0]))
                op = ConvPool(tuple(s.in_shapes[0]), s.args["filters"], s.args["kernel_size"][0])
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
                from ringtrain_trainer.engine.ops.frozen import Frozen

                op = Frozen(op, inference=s.cls == "BatchNormalization")
            if reg is not None:
                from ringtrain_trainer.engine.ops import activity, regularizers

                r = regularizers.parse(reg, "activity_regularizer")
                assert r is not None
                op = activity.WithActivity(op, r.l1, r.l2)
            op.name = "+".join(x.name for x in group)
            srcs = [where[t] for t in s.inputs]
            if s.args.get("dropout") and s.cls in ("LSTM", "GRU", "SimpleRNN"):
                srcs[0] = _input_dropout(s, i, ops, nodes, srcs[0])
            n = len(ops)
            nodes.append(Node(n, (*srcs, *extra), n + 1))
            ops.append(op)
            for g in group:
                where[g.output] = n + 1
            owner[i] = n
        self.owner = owner
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
        #: several inputs: each one's own shape; the program's ``x`` packs them row-major
        self.graph_input_shapes = [tuple(x.shape) for x in ins] if len(ins) > 1 else None
        if self.graph_input_shapes:
            ipu_input = (sum(math.prod(x.shape) for x in ins),)
        #: the IPU program's input shape: the Keras input after any leading Reshape/Flatten
        #: (same bytes, row-major); ``config.input_shape`` is what the Keras model takes
        super().__init__(
            name, ops, tuple(ipu_input), sum(widths), graph=graph, loss=loss, ties=ties
        )
        self.slots = weight_args.with_weight_args(self.slots, config.layers, owner)
        self.initial = initial  # (flat, state) from a .keras archive, or None
        #: parameters held frozen (``trainable=False``): state, never trained or reduced
        self.num_frozen = sum(getattr(op, "frozen_size", 0) for op in ops)
        if self.num_frozen and not self.num_params:
            raise InvalidSpec(
                "model: every weight of the model is frozen (trainable=False): nothing to "
                "train (supported: at least one trainable layer)"
            )

    def init(self, seed: int, dtype=np.float32) -> np.ndarray:
        if self.initial is not None:
            return self.initial[0].astype(dtype)
        self._need_start_for_frozen()
        return super().init(seed, dtype)

    def init_state(self, dtype=np.float32) -> np.ndarray:
        if self.initial is not None:
            return self.initial[1].astype(dtype)
        return super().init_state(dtype)

    def _need_start_for_frozen(self) -> None:
        """Frozen weights are never trained, so fresh random ones would stay random: a model
        with a frozen layer must start from a ``.keras`` file's (or a checkpoint's) weights."""
        first = next(
            (s for s in self.config.layers if s.frozen and archive.weights_of_layer(s)), None
        )
        if first is not None:
            raise InvalidSpec(
                f"model: layer {first.name!r} ({first.cls}): trainable=False needs starting "
                "weights (give --model a .keras file; fresh frozen weights would stay random)"
            )

    # -- back to Keras -------------------------------------------------------------------
    def keras_config(self, precision: str | None = None) -> dict:
        """A Keras 3 config (``model.to_json()`` shape, Sequential or Functional as the
        source) that Keras loads, compiled with the loss that ran; ``precision``: the run's,
        for the layers' dtype policies (``archive.layer_dtype``)."""
        return _free_dims(
            archive.to_keras(
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
            ),
            self.declared_input_shape,
        )

    def _weight_refs(self):
        """(keras layer, weight name, where, ipu op) in get_weights order; where is "p"
        (trainable, the flat buffer) or "s" (state)."""
        for s, li in zip(self.config.layers, self.owner, strict=True):
            for w in archive.weights_of_layer(s):
                yield s, w.name, "p" if w.trainable and not s.frozen else "s", li

    def keras_shapes(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Each trainable slot's (start, stop) in the flat buffer and its Keras shape (the
        flat data is in that shape's row-major order: :meth:`keras_weights` only reshapes)."""
        shapes = {
            (li, w.name): tuple(w.shape)
            for s, li in zip(self.config.layers, self.owner, strict=True)
            for w in archive.weights_of_layer(s)
        }
        return [(x.start, x.stop, shapes[(x.spec.layer, x.spec.name)]) for x in self.slots]

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
            if w == "s" and np.ndim(arr) > 1 and dst.size == np.size(arr):  # a frozen kernel
                dst = dst.reshape(np.shape(arr))
            elif _squeezed(np.shape(arr)) == _squeezed(dst.shape):  # the same bytes in order
                dst = dst.reshape(np.shape(arr))  # ConvNeXt's Conv2D(groups=C): (*k, 1, C)
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


def _squeezed(shape: tuple) -> tuple:
    return tuple(d for d in shape if d != 1)


#: one example's shape in the training data, asked (with the declared shape) only of a model
#: with free input dimensions
DataShape = Callable[[tuple], tuple[int, ...]] | None


def any_length(declared: tuple) -> tuple[int, ...]:
    """A :data:`DataShape` for where no data is at hand (an export from a checkpoint, the
    operator's validation): the free dimensions at ``archive.ANY_LENGTH``; the weights'
    shapes do not depend on them."""
    return tuple(archive.ANY_LENGTH if d is None else d for d in declared)


def from_config(
    model: dict,
    name: str = "keras",
    budget: tuple[int, int] | None = None,
    fresh: bool = True,
    data: DataShape = None,
) -> KerasModel:
    """A :class:`KerasModel` from a decoded ``model.to_json()`` dict (either Keras format).
    ``budget`` (one IPU's bytes, examples per IPU): refuse a model that cannot fit it by
    arithmetic (``budget.check``) before building anything proportional to its size.
    ``fresh``: no starting weights come with it (a config, not a ``.keras`` file), so a frozen
    layer is refused here — in the operator's spec check too — not at the worker's start.
    ``data``: where the model's input has None dimensions, they are fixed to the data's
    (``keras.config.fix_input_shape``); the model remembers what it declared."""
    declared = free_input_shape(model)
    if declared is not None and data is not None:
        model = fix_input_shape(model, data(declared))
    config = parse(model)
    if budget is not None:
        budget_mod.check(config, *budget)
    spec = KerasModel(name, config)
    if fresh:
        spec._need_start_for_frozen()
    if declared is not None:
        spec.declared_input_shape = declared
    return spec


def _free_dims(doc: dict, declared: tuple | None) -> dict:
    """An export's config with the model's declared None dimensions back on its input, so
    Keras takes any length as the source did (the weights do not depend on it)."""
    if declared is None:
        return doc
    for layer in doc["config"]["layers"]:
        if layer.get("class_name") == "InputLayer":
            layer["config"]["batch_shape"] = [None, *declared]
    doc["build_config"] = {"input_shape": [None, *declared]}
    return doc


def preset_config(name: str) -> dict:
    text = resources.files("ringtrain_trainer").joinpath(f"presets/{name}.json").read_text()
    return json.loads(text)


def read_keras_archive(
    path: Path, budget: tuple[int, int] | None = None, data: DataShape = None
) -> tuple[dict, list[np.ndarray], KerasModel]:
    """config, weights in ``get_weights`` order, and the model, from a ``.keras`` zip."""
    config, weights = archive.read_keras(path)
    return config, weights, from_config(config, str(path), budget, fresh=False, data=data)


def describe(source: str) -> str:
    """``--model``'s value for a log line: an inline config by its name, not its whole text."""
    if not source.lstrip().startswith("{"):
        return repr(source)
    try:
        name = (json.loads(source).get("config") or {}).get("name")
    except (ValueError, AttributeError):
        name = None
    return f"inline Keras config {name or 'sequential'!r}"


def load(source: str, budget: tuple[int, int] | None = None, data: DataShape = None) -> KerasModel:
    """``--model``: a preset name, a ``.json`` file of ``model.to_json()``, a ``.keras``
    file whose weights become the starting point, or ``model.to_json()``'s text itself (how the
    operator passes ``spec.trainer.model`` written inline; a checkpoint records it the same way,
    so ``ringtrain export`` rebuilds the model from the checkpoint alone). ``budget``: see
    :func:`from_config`, as ``data``."""
    if source in PRESETS:
        return from_config(preset_config(source), source, budget)
    if source.lstrip().startswith("{"):
        try:
            config = json.loads(source)
        except ValueError as e:
            raise InvalidSpec(f"--model: inline Keras config is not JSON ({e})") from None
        return from_config(config, "inline", budget, data=data)
    path = Path(source)
    if path.suffix == ".keras" and path.is_file():
        _, weights, spec = read_keras_archive(path, budget, data)
        spec.initial = spec.from_keras_weights(weights)
        return spec
    if path.suffix == ".json" and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidSpec(f"--model {source}: cannot read a Keras config ({e})") from None
        return from_config(config, source, budget, data=data)
    raise InvalidSpec(
        f"--model: unknown model {source!r} (known: {', '.join(PRESETS)}; "
        "or a path to a .json file of model.to_json() or a .keras file, or "
        "model.to_json()'s text)"
    )
