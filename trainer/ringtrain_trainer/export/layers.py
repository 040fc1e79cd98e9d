"""A Keras 3 Sequential config read as a list of layers with shapes and weights attached.

Pipeline position: both writers (``.keras`` and ONNX) and the reader start here. It depends on
nothing but the config dict (what ``model.to_json()`` gives, parsed) and the weights in
``model.get_weights()`` order, so the writers can be tested against real Keras models without
the trainer. Shapes are inferred the way Keras does (``padding="same"`` is ``ceil(n / s)``),
which lets every weight be checked against its layer before a file is written, and gives the
ONNX writer the explicit pads TensorFlow uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ringtrain.errors import InvalidSpec

#: the layers every writer supports (the issue's list); anything else is refused by name
SUPPORTED = (
    "InputLayer",
    "Conv2D",
    "MaxPooling2D",
    "AveragePooling2D",
    "GlobalAveragePooling2D",
    "Flatten",
    "Reshape",
    "Rescaling",
    "Dense",
    "Dropout",
    "Activation",
    "ReLU",
    "Softmax",
    "BatchNormalization",
)
ACTIVATIONS = ("relu", "sigmoid", "tanh", "softmax", "linear")


def snake_case(name: str) -> str:
    """Keras' ``naming.to_snake_case``: ``MaxPooling2D`` → ``max_pooling2d`` (h5 group names)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


@dataclass
class Layer:
    """One layer of the model: Keras class, its config, shapes without the batch axis, weights."""

    cls: str
    cfg: dict
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weight_shapes: list[tuple[int, ...]] = field(default_factory=list)
    weights: list[np.ndarray] = field(default_factory=list)

    def refuse(self, arg: str, value, supported: str) -> InvalidSpec:
        return InvalidSpec(
            f"layer {self.name!r} ({self.cls}): {arg}={value!r} is not supported "
            f"(supported: {supported})"
        )


def sequential_layers(keras_config: dict) -> list[dict]:
    """The layer list of a Sequential config, refusing anything that is not one."""
    if not isinstance(keras_config, dict) or keras_config.get("class_name") != "Sequential":
        got = keras_config.get("class_name") if isinstance(keras_config, dict) else keras_config
        raise InvalidSpec(f"model config: only Sequential models are supported, got {got!r}")
    layers = (keras_config.get("config") or {}).get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidSpec("model config: a Sequential config needs a non-empty 'layers' list")
    return layers


def pair(v, what: str, layer: str) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return int(v[0]), int(v[1])
    raise InvalidSpec(f"layer {layer!r}: {what}={v!r} must be an int or a pair of ints")


def input_shape(keras_config: dict) -> tuple[int, ...]:
    """The model's input shape without the batch axis: InputLayer's ``batch_shape`` (Keras 3),
    ``batch_input_shape`` (tf.keras 2) on the first layer, or ``build_input_shape``."""
    layers = sequential_layers(keras_config)
    first = layers[0].get("config", {})
    for key in ("batch_shape", "batch_input_shape"):
        if first.get(key):
            return tuple(first[key][1:])
    if first.get("shape"):
        return tuple(first["shape"])
    for holder in (keras_config.get("config", {}), keras_config.get("build_config") or {}):
        shape = holder.get("build_input_shape") or holder.get("input_shape")
        if shape:
            return tuple(shape[1:])
    raise InvalidSpec("model config: no input shape (give an InputLayer with batch_shape)")


def activation_name(layer: Layer, value) -> str:
    """``relu`` from ``"relu"``, None, or a serialized function dict; refuses the rest."""
    if value is None:
        return "linear"
    if isinstance(value, dict):
        value = (
            value.get("config") if isinstance(value.get("config"), str) else value.get("class_name")
        )
    if value not in ACTIVATIONS:
        raise layer.refuse("activation", value, ", ".join(ACTIVATIONS))
    return value


def _pool_out(n: int, k: int, s: int, padding: str) -> int:
    return -(-n // s) if padding == "same" else (n - k) // s + 1


def _padding(layer: Layer) -> str:
    padding = layer.cfg.get("padding", "valid")
    if padding not in ("valid", "same"):
        raise layer.refuse("padding", padding, "valid, same")
    if layer.cfg.get("data_format") not in (None, "channels_last"):
        raise layer.refuse("data_format", layer.cfg["data_format"], "channels_last")
    return padding


def _infer(layer: Layer) -> None:
    """Fill in ``out_shape`` and ``weight_shapes`` (``get_weights()`` order) from the config."""
    c, s = layer.cfg, layer.in_shape
    cls = layer.cls
    layer.out_shape = s
    spatial = ("Conv2D", "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D")
    if cls in spatial and len(s) != 3:
        raise InvalidSpec(
            f"layer {layer.name!r} ({cls}): needs (height, width, channels) input, got {s}"
        )
    if cls == "Conv2D":
        kh, kw = pair(c.get("kernel_size"), "kernel_size", layer.name)
        sh, sw = pair(c.get("strides", 1), "strides", layer.name)
        padding = _padding(layer)
        if pair(c.get("dilation_rate", 1), "dilation_rate", layer.name) != (1, 1):
            raise layer.refuse("dilation_rate", c["dilation_rate"], "1")
        if c.get("groups", 1) != 1:
            raise layer.refuse("groups", c["groups"], "1")
        f = int(c["filters"])
        layer.out_shape = (_pool_out(s[0], kh, sh, padding), _pool_out(s[1], kw, sw, padding), f)
        layer.weight_shapes = [(kh, kw, s[2], f)] + ([(f,)] if c.get("use_bias", True) else [])
        activation_name(layer, c.get("activation"))
    elif cls in ("MaxPooling2D", "AveragePooling2D"):
        kh, kw = pair(c.get("pool_size", 2), "pool_size", layer.name)
        sh, sw = pair(c.get("strides") or (kh, kw), "strides", layer.name)
        padding = _padding(layer)
        layer.out_shape = (_pool_out(s[0], kh, sh, padding), _pool_out(s[1], kw, sw, padding), s[2])
    elif cls == "GlobalAveragePooling2D":
        _padding(layer)
        layer.out_shape = (1, 1, s[2]) if c.get("keepdims") else (s[2],)
    elif cls == "Flatten":
        layer.out_shape = (math.prod(s),)
    elif cls == "Reshape":
        target = list(c["target_shape"])
        if -1 in target:
            known = math.prod(t for t in target if t != -1)
            target[target.index(-1)] = math.prod(s) // known
        if math.prod(target) != math.prod(s):
            raise InvalidSpec(
                f"layer {layer.name!r} (Reshape): cannot reshape {s} to {tuple(c['target_shape'])}"
            )
        layer.out_shape = tuple(target)
    elif cls == "Dense":
        layer.out_shape = (*s[:-1], int(c["units"]))
        layer.weight_shapes = [(s[-1], int(c["units"]))] + (
            [(int(c["units"]),)] if c.get("use_bias", True) else []
        )
        activation_name(layer, c.get("activation"))
    elif cls == "BatchNormalization":
        axis = c.get("axis", -1)
        if isinstance(axis, list) and len(axis) == 1:
            axis = axis[0]
        if axis not in (-1, len(s)):
            raise layer.refuse("axis", axis, "-1 (the channel axis)")
        n = int(c.get("scale", True)) + int(c.get("center", True)) + 2
        layer.weight_shapes = [(s[-1],)] * n
    elif cls == "Activation":
        activation_name(layer, c.get("activation"))
    elif cls == "ReLU":
        if c.get("max_value") is not None:
            raise layer.refuse("max_value", c["max_value"], "None (a plain ReLU)")
        for arg in ("negative_slope", "threshold"):
            if c.get(arg) or 0:
                raise layer.refuse(arg, c[arg], "0 (a plain ReLU)")
    elif cls == "Softmax" and c.get("axis", -1) not in (-1, len(s), [-1]):
        raise layer.refuse("axis", c["axis"], "-1")


def parse(keras_config: dict) -> list[Layer]:
    """Every layer of the model after the input, with shapes; refuses unsupported layers."""
    shape = input_shape(keras_config)
    out: list[Layer] = []
    for i, raw in enumerate(sequential_layers(keras_config)):
        cls, cfg = raw.get("class_name"), raw.get("config") or {}
        name = cfg.get("name") or f"layer {i}"
        if cls not in SUPPORTED:
            raise InvalidSpec(
                f"layer {name!r}: class {cls!r} is not supported "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        if cls == "InputLayer":
            continue
        layer = Layer(cls, cfg, name, shape, shape)
        _infer(layer)
        shape = layer.out_shape
        out.append(layer)
    return out


def bind(keras_config: dict, weights: list[np.ndarray]) -> list[Layer]:
    """:func:`parse`, then hand each layer its weights (``get_weights()`` order), checking
    the count and every shape so a mismatch names the layer instead of corrupting a file."""
    layers = parse(keras_config)
    need = sum(len(layer.weight_shapes) for layer in layers)
    if len(weights) != need:
        raise InvalidSpec(f"model has {need} weight arrays but {len(weights)} were given")
    it = iter(weights)
    for layer in layers:
        for expected in layer.weight_shapes:
            w = np.asarray(next(it), dtype=np.float32)
            if tuple(w.shape) != tuple(expected):
                raise InvalidSpec(
                    f"layer {layer.name!r} ({layer.cls}): weight "
                    f"{len(layer.weights)} has shape {tuple(w.shape)}, "
                    f"expected {tuple(expected)}"
                )
            layer.weights.append(w)
    return layers
