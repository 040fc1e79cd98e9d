"""From a Keras model (preset, ``model.to_json()`` file, ``.keras`` archive) to IPU ops, and
back.

Pipeline position: ``--model`` → :func:`load` → :class:`KerasModel`, a ``model.ModelSpec`` the
IPU compiles like any other. The layers come from ``keras.config.parse`` (everything refused
there, before anything runs); each is built into an engine op by its registry entry
(``keras/registry.py``) and wired into the engine's ``Graph`` as the config wires it. Passes over
that graph, each keeping the numbers of the unfused ops:

* ``Conv2D`` (square kernel, 'valid', stride 1, ReLU, bias) whose only reader is a
  ``MaxPooling2D(2)`` becomes ``engine.ops.fused.ConvPool``, the fused kernel the seeds' CNN uses;
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
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np

from ringtrain import options
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.keras import archive, weight_args
from ringtrain_trainer.keras import budget as budget_mod
from ringtrain_trainer.keras.config import ModelConfig, fix_input_shape, free_input_shape, parse
from ringtrain_trainer.keras.layer_spec import LayerSpec
from ringtrain_trainer.keras.lowering import lower

#: the presets shipped as Keras configs (``presets/*.json``): the option table's list
PRESETS = options.MODELS


class KerasModel(ModelSpec):
    """A :class:`ModelSpec` built from a Keras config, which it remembers."""

    def __init__(self, name: str, config: ModelConfig, initial=None):
        self.config = config
        self.numerics = config.numerics
        self.loss_from_logits = True  # the IPU's loss always reads logits (see module doc)
        low = lower(config)
        #: per Keras layer: the op holding its weights (None: folded away)
        self.owner = low.owner
        ins = config.inputs
        self.graph_input_shapes = [tuple(x.shape) for x in ins] if len(ins) > 1 else None
        #: the IPU program's input shape: the Keras input after any leading Reshape/Flatten
        #: (same bytes, row-major); ``config.input_shape`` is what the Keras model takes
        super().__init__(
            name,
            low.ops,
            low.ipu_input,
            sum(low.widths),
            graph=low.graph,
            loss=low.loss,
            ties=low.ties,
        )
        self.slots = weight_args.with_weight_args(self.slots, config.layers, low.owner)
        self.initial = initial  # (flat, state) from a .keras archive, or None
        self.num_frozen = sum(getattr(op, "frozen_size", 0) for op in low.ops)
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
        source) that Keras loads, compiled with the loss that ran and the source's metrics;
        ``precision``: the run's,
        for the layers' dtype policies (``archive.layer_dtype``)."""
        return _free_dims(
            archive.to_keras(
                self.config,
                {
                    "optimizer": "adam",
                    "loss": self.config.loss.keras(),
                    "metrics": self.config.compiled_metrics.get("metrics"),
                    "loss_weights": (
                        self.config.loss.keras_weights()
                        if isinstance(self.config.loss, MultiLossSpec)
                        else None
                    ),
                    "weighted_metrics": self.config.compiled_metrics.get("weighted_metrics"),
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
    config, weights = archive.read_keras(path, None if budget is None else budget[0])
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


def build(name: str, data=None) -> KerasModel:
    """A preset name, a ``.json`` file of ``model.to_json()`` or a ``.keras`` file (:func:`load`,
    ``data`` as there); the presets are Keras configs shipped with the package."""
    return load(name, data=data)
