"""From a Keras model (preset, ``model.to_json()`` file, ``.keras`` archive) to IPU layers, and
back.

Pipeline position: ``--model`` → :func:`load` → :class:`KerasModel`, a ``model.ModelSpec`` the
IPU compiles like any other. The layers come from ``keras_config.parse`` (everything refused
there, before anything runs) and are mapped onto IPU layers:

* ``Conv2D`` (square kernel, 'valid', stride 1, ReLU, bias) directly followed by
  ``MaxPooling2D(2)`` becomes ``layers.fused.ConvPool``, the fused kernel the hand-written CNNs
  use; ``Dense`` with bias and ReLU/linear becomes ``layers.fused.Dense``. So the presets — and the
  same model written by a user — keep today's parameter layout, numbers and speed.
* everything else becomes a layer of ``layers``.
* a final softmax (categorical losses) or sigmoid (binary cross-entropy) is folded into the
  loss, as Keras itself does: its TensorFlow backend computes the cross-entropy from the
  activation's input (its ``_keras_logits``) whether ``from_logits`` is False or — with a
  warning — True. The IPU's last layer then outputs logits (``engine.losses``).

Going back, :meth:`KerasModel.keras_config` writes a Keras 3 ``Sequential`` config and
:meth:`KerasModel.keras_weights` the arrays in ``model.get_weights()`` order, which is also the
order of ``layers/<name>/vars/<i>`` in a ``.keras`` archive's ``model.weights.h5``.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import budget as budget_mod
from ringtrain_trainer import keras_config as K
from ringtrain_trainer import layers as L
from ringtrain_trainer.layers.fused import ConvPool, Dense
from ringtrain_trainer.model import ModelSpec

PRESETS = ("cnn", "cnn2")
#: Keras weights per layer class, in ``get_weights`` order: (where, name); where is "p"
#: (trainable, the flat buffer) or "s" (state)
_WEIGHTS = {
    K.Conv2D: (("p", "kernel"), ("p", "bias")),
    K.Dense: (("p", "kernel"), ("p", "bias")),
    K.BatchNorm: (("p", "gamma"), ("p", "beta"), ("s", "moving_mean"), ("s", "moving_variance")),
}
_CLASS = {
    K.Conv2D: "Conv2D",
    K.Dense: "Dense",
    K.BatchNorm: "BatchNormalization",
    K.Flatten: "Flatten",
    K.Reshape: "Reshape",
    K.Rescaling: "Rescaling",
    K.Dropout: "Dropout",
    K.GlobalAvgPool2D: "GlobalAveragePooling2D",
}


class KerasModel(ModelSpec):
    """A :class:`ModelSpec` built from a Keras Sequential config, which it remembers."""

    def __init__(self, name: str, config: K.ModelConfig, initial=None):
        self.config = config
        self.loss_from_logits = True  # the IPU's loss always reads logits (see module doc)
        layers, owner, shape = [], [], config.input_shape
        ipu_input = shape
        specs = config.layers
        i = 0
        while i < len(specs):
            s, nxt = specs[i], specs[i + 1] if i + 1 < len(specs) else None
            last = nxt is None
            layer, used = _map(s, nxt, shape, i, config.loss.folded if last else None)
            if isinstance(layer, L.Reshape) and (
                not layers or (len(layer.out_shape) == 1 and isinstance(nxt, K.Dense))
            ):
                # folded: the program's input buffer takes the new shape, and Dense
                # flattens its input itself (today's layer indices and speed)
                shape, layer = layer.out_shape, None
                if not layers:
                    ipu_input = shape
            if layer is not None:
                layer.name = "+".join(x.name for x in specs[i : i + used])
                layers.append(layer)
                shape = layer.out_shape
            owner.extend([len(layers) - 1 if layer is not None else None] * used)
            i += used
        kind = config.loss.kind
        if len(shape) != 1 or (shape[0] < 2 and kind in ("sparse", "categorical")):
            raise InvalidSpec(
                f"model: the output shape is {shape}; "
                + (
                    "a classifier needs one score per class (end with Dense(num_classes))"
                    if kind in ("sparse", "categorical")
                    else f"{config.loss.name} needs a flat output (end with Dense(units))"
                )
            )
        #: per Keras layer: the IPU layer holding its weights (None: folded away)
        self.owner = owner
        if not layers:
            raise InvalidSpec("model: the config has no layer with weights or computation")
        #: the IPU program's input shape: the Keras input after any leading Reshape/Flatten
        #: (same bytes, row-major); ``config.input_shape`` is what the Keras model takes
        super().__init__(name, layers, tuple(ipu_input), shape[0], loss=config.loss)
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
    def keras_config(self) -> dict:
        """A Keras 3 ``Sequential`` config (``model.to_json()`` shape) that Keras loads."""
        cfg = self.config
        items = [
            {
                "module": "keras.layers",
                "class_name": "InputLayer",
                "config": {
                    "batch_shape": [None, *cfg.input_shape],
                    "dtype": "float32",
                    "name": "input_layer",
                },
                "registered_name": None,
            }
        ]
        items += [
            {
                "module": "keras.layers",
                "class_name": _class_name(s),
                "config": {"name": s.name, "trainable": True, "dtype": "float32", **_keras_args(s)},
                "registered_name": None,
            }
            for s in cfg.layers
        ]
        loss = cfg.loss.keras()
        return {
            "module": "keras",
            "class_name": "Sequential",
            "config": {"name": cfg.name, "trainable": True, "dtype": "float32", "layers": items},
            "registered_name": None,
            "build_config": {"input_shape": [None, *cfg.input_shape]},
            "compile_config": {
                "optimizer": "adam",
                "loss": loss,
                "metrics": None,
                "loss_weights": None,
                "weighted_metrics": None,
                "run_eagerly": False,
                "steps_per_execution": 1,
                "jit_compile": False,
            },
        }

    def _weight_refs(self):
        """(keras layer, keras weight name, where, ipu layer, name) in get_weights order."""
        for s, li in zip(self.config.layers, self.owner, strict=True):
            for where, wname in _WEIGHTS.get(type(s), ()):
                present = (
                    {p.name for p in self.layers[li].params(li)}
                    if where == "p"
                    else {n for n, _, _ in self.state_specs[li]}
                )
                if wname in present:
                    yield s, wname, where, li

    def keras_weights(
        self, flat_params: np.ndarray, state: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """Arrays in ``model.get_weights()`` order (kernel HWIO / (in, out) as Keras)."""
        state = self.init_state() if state is None else state
        pv, sv = self.views(flat_params), self.state_views(state)
        return [
            np.array((pv if w == "p" else sv)[li][n], np.float32)
            for _, n, w, li in self._weight_refs()
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
            if tuple(np.shape(arr)) != dst.shape:
                raise InvalidSpec(
                    f"model {self.name!r}: layer {s.name!r} weight {n} has "
                    f"shape {np.shape(arr)}, the config needs {dst.shape}"
                )
            dst[...] = arr
        return flat, state

    def h5_groups(self) -> list[tuple[K.Dense, str]]:
        """Each Keras layer with its ``model.weights.h5`` group (snake-case class, deduped)."""
        seen: dict[str, int] = {}
        out = []
        for s in self.config.layers:
            base = K.snake_case(_class_name(s))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.append((s, f"layers/{base}" + (f"_{n}" if n else "")))
        return out


def _class_name(s) -> str:
    if isinstance(s, K.Pool2D):
        return "MaxPooling2D" if s.kind == "max" else "AveragePooling2D"
    if isinstance(s, K.Activation):
        return s.class_name
    return _CLASS[type(s)]


def _keras_args(s) -> dict:
    if isinstance(s, K.Conv2D):
        return {
            "filters": s.filters,
            "kernel_size": list(s.kernel),
            "strides": list(s.strides),
            "padding": s.padding,
            "data_format": "channels_last",
            "activation": s.activation,
            "use_bias": s.use_bias,
        }
    if isinstance(s, K.Pool2D):
        return {
            "pool_size": list(s.pool),
            "strides": list(s.strides),
            "padding": s.padding,
            "data_format": "channels_last",
        }
    if isinstance(s, K.Dense):
        return {"units": s.units, "activation": s.activation, "use_bias": s.use_bias}
    if isinstance(s, K.BatchNorm):
        return {
            "axis": -1,
            "momentum": s.momentum,
            "epsilon": s.epsilon,
            "center": s.center,
            "scale": s.scale,
        }
    if isinstance(s, K.Activation):
        return {"activation": s.activation} if s.class_name == "Activation" else {}
    if isinstance(s, K.Reshape):
        return {"target_shape": list(s.target_shape)}
    if isinstance(s, K.Rescaling):
        return {"scale": s.scale, "offset": s.offset}
    if isinstance(s, K.Dropout):
        return {"rate": s.rate}
    return {}


def _need(s, shape, rank: int, what: str) -> None:
    if len(shape) != rank:
        raise InvalidSpec(
            f"model: layer {s.name!r} ({_class_name(s)}) got an input of shape "
            f"{shape}; it needs {what}"
        )


def _map(s, nxt, shape, index: int, fold: str | None):
    """(IPU layer or None, how many Keras layers it consumes); ``fold``: the last layer's
    activation that the loss computes itself (``softmax`` / ``sigmoid``), or None."""
    if isinstance(s, K.Conv2D):
        _need(s, shape, 3, "an H×W×C input (add a Reshape before it)")
        if (
            isinstance(nxt, K.Pool2D)
            and nxt.kind == "max"
            and nxt.pool == (2, 2)
            and nxt.strides == (2, 2)
            and nxt.padding == "valid"
            and s.kernel[0] == s.kernel[1]
            and s.strides == (1, 1)
            and s.padding == "valid"
            and s.activation == "relu"
            and s.use_bias
            and min(shape[0], shape[1]) - s.kernel[0] + 1 >= 2
        ):
            return ConvPool(tuple(shape), s.filters, s.kernel[0]), 2
        return _checked(
            s,
            lambda: L.Conv2D(
                tuple(shape), s.filters, s.kernel, s.strides, s.padding, s.activation, s.use_bias
            ),
        ), 1
    if isinstance(s, K.Pool2D):
        _need(s, shape, 3, "an H×W×C input")
        return _checked(s, lambda: L.Pool2D(tuple(shape), s.kind, s.pool, s.strides, s.padding)), 1
    if isinstance(s, K.Dense):
        _need(s, shape, 1, "a flat input (add Flatten before it)")
        act = "linear" if fold and s.activation == fold else s.activation
        if s.use_bias and act in ("relu", "linear"):
            return Dense(shape[0], s.units, act == "relu"), 1
        return L.Linear(shape[0], s.units, act, s.use_bias), 1
    if isinstance(s, K.Activation):
        if fold and s.activation == fold:
            return None, 1
        return L.Elementwise(shape, s.activation), 1
    if isinstance(s, K.Rescaling):
        return L.Elementwise(shape, scale=s.scale, offset=s.offset), 1
    if isinstance(s, K.Flatten):
        return L.Reshape(shape, (math.prod(shape),)), 1
    if isinstance(s, K.Reshape):
        t = list(s.target_shape)
        if t.count(-1) == 1:
            known = math.prod(d for d in t if d != -1)
            t[t.index(-1)] = math.prod(shape) // max(known, 1)
        if math.prod(t) != math.prod(shape) or t.count(-1):
            raise InvalidSpec(
                f"model: layer {s.name!r} (Reshape): target_shape "
                f"{list(s.target_shape)} does not fit its input {shape}"
            )
        return L.Reshape(shape, tuple(t)), 1
    if isinstance(s, K.GlobalAvgPool2D):
        _need(s, shape, 3, "an H×W×C input")
        return L.GlobalAvgPool2D(tuple(shape)), 1
    if isinstance(s, K.Dropout):
        return L.Dropout(shape, s.rate, index), 1
    if isinstance(s, K.BatchNorm):
        return L.BatchNorm(shape, s.momentum, s.epsilon, s.center, s.scale), 1
    raise InvalidSpec(f"model: layer {s.name!r} is not supported")


def _checked(s, make):
    try:
        return make()
    except ValueError as e:
        raise InvalidSpec(f"model: layer {s.name!r} ({_class_name(s)}): {e}") from None


def from_config(
    model: dict, name: str = "keras", budget: tuple[int, int] | None = None
) -> KerasModel:
    """A :class:`KerasModel` from a decoded ``model.to_json()`` dict (either Keras format).
    ``budget`` (one IPU's bytes, examples per IPU): refuse a model that cannot fit it by
    arithmetic (``budget.check``) before building anything proportional to its size."""
    config = K.parse(model)
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
    import h5py

    try:
        with zipfile.ZipFile(path) as z:
            config = json.loads(z.read("config.json"))
            blob = z.read("model.weights.h5")
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise InvalidSpec(f"--model {path}: not a Keras .keras archive ({e})") from None
    spec = from_config(config, str(path), budget)
    weights = []
    with h5py.File(io.BytesIO(blob), "r") as f:
        for s, group in spec.h5_groups():
            n = len(_WEIGHTS.get(type(s), ()))
            if not n:
                continue
            if group not in f:
                raise InvalidSpec(
                    f"--model {path}: model.weights.h5 has no {group} for layer {s.name!r}"
                )
            v = f[group]["vars"]
            weights += [np.asarray(v[str(i)]) for i in range(len(v))]
    return config, weights, spec


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
