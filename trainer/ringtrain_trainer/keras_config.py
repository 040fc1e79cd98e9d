"""Parse a Keras ``Sequential`` config into validated layer specs, refusing what we cannot run.

Pipeline position: the first step of ``--model`` / ``spec.trainer.model``. Input is what
``model.to_json()`` writes — the Keras 3 format (TensorFlow ≥ 2.16: ``module``, ``class_name``,
``config``, ``registered_name``, ``build_config``) or the tf.keras 2 format (``class_name`` and
``config`` only, ``batch_input_shape``) — already decoded to a dict. Output is a
:class:`ModelConfig`: frozen dataclasses, one per layer, that ``keras_model`` turns into IPU
layers. Everything is checked here, *before anything runs*: an unsupported layer, argument or
value raises :class:`InvalidSpec` naming the layer (name and class), the argument, and what is
supported, so ``render``, ``run`` and the operator refuse a job with the same words.

Arguments that only matter for Keras bookkeeping (``name``, ``trainable`` of a layer without
weights, ``dtype`` float32, ``seed`` of an initializer) are accepted; every other argument must
be one this module knows, with a supported value — an unknown argument is refused rather than
silently ignored. ``trainable=False`` on a layer with weights (or on the model) is refused: the
trainer trains every weight, and a frozen BatchNormalization even runs in inference mode in Keras.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import losses
from ringtrain_trainer.optim.registry import OptimizerSpec, from_compile_config

ACTIVATIONS = ("relu", "sigmoid", "tanh", "softmax", "linear")


@dataclass(frozen=True)
class Conv2D:
    name: str
    filters: int
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: str = "valid"
    activation: str = "linear"
    use_bias: bool = True


@dataclass(frozen=True)
class Pool2D:
    name: str
    kind: str  # "max" | "avg"
    pool: tuple[int, int] = (2, 2)
    strides: tuple[int, int] = (2, 2)
    padding: str = "valid"


@dataclass(frozen=True)
class GlobalAvgPool2D:
    name: str


@dataclass(frozen=True)
class Flatten:
    name: str


@dataclass(frozen=True)
class Reshape:
    name: str
    target_shape: tuple[int, ...]


@dataclass(frozen=True)
class Rescaling:
    name: str
    scale: float
    offset: float = 0.0


@dataclass(frozen=True)
class Dense:
    name: str
    units: int
    activation: str = "linear"
    use_bias: bool = True


@dataclass(frozen=True)
class Dropout:
    name: str
    rate: float


@dataclass(frozen=True)
class Activation:
    name: str
    activation: str
    class_name: str = "Activation"


@dataclass(frozen=True)
class BatchNorm:
    name: str
    momentum: float = 0.99
    epsilon: float = 1e-3
    center: bool = True
    scale: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """A validated Sequential model: input shape (no batch axis), layers, loss, and the
    optimizer of its compile settings (None: it has none)."""

    name: str
    input_shape: tuple[int, ...]
    layers: tuple
    from_logits: bool
    optimizer: OptimizerSpec | None = None
    #: the loss that runs (``engine.losses``): the compile settings', with any final softmax
    #: or sigmoid folded into it
    loss: losses.LossSpec = losses.DEFAULT

    @property
    def ends_in_softmax(self) -> bool:
        last = self.layers[-1] if self.layers else None
        return getattr(last, "activation", None) == "softmax"


def snake_case(class_name: str) -> str:
    """Keras' ``naming.to_snake_case`` — how ``model.weights.h5`` names a layer's group."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


class _Args:
    """One layer's config, consumed argument by argument; leftovers are refused."""

    IGNORED = ("name", "trainable", "dtype")

    def __init__(self, layer: dict, index: int):
        self.cls = layer.get("class_name", "?")
        self.cfg = dict(layer.get("config") or {})
        self.name = str(self.cfg.get("name") or f"layer {index}")
        self.where = f"layer {self.name!r} ({self.cls})"
        dtype = self.cfg.get("dtype")
        if isinstance(dtype, dict):
            dtype = (dtype.get("config") or {}).get("name")
        if dtype not in (None, "float32"):
            self.refuse("dtype", dtype, "float32")

    def refuse(self, arg: str, value: Any, supported: str) -> None:
        raise InvalidSpec(
            f"model: {self.where}: {arg}={value!r} is not supported (supported: {supported})"
        )

    def take(self, arg: str, default: Any = None) -> Any:
        return self.cfg.pop(arg, default)

    def must_be(self, arg: str, *allowed: Any) -> None:
        v = self.take(arg, allowed[0])
        if v not in allowed:
            self.refuse(arg, v, " or ".join(repr(a) for a in allowed))

    def pair(self, arg: str, default: Any) -> tuple[int, int]:
        v = self.take(arg, default)
        v = (v, v) if isinstance(v, int) else tuple(v)
        if len(v) != 2 or not all(isinstance(i, int) and i >= 1 for i in v):
            self.refuse(arg, v, "a positive int or a pair of them")
        return v

    def activation(self, arg: str = "activation") -> str:
        v = self.take(arg, "linear")
        v = "linear" if v is None else v
        if v not in ACTIVATIONS:
            self.refuse(arg, v, ", ".join(ACTIVATIONS))
        return v

    def initializer(self, arg: str, default: str) -> None:
        v = self.take(arg, default)
        cls = v.get("class_name") if isinstance(v, dict) else v
        cfg = v.get("config") or {} if isinstance(v, dict) else {}
        if snake_case(str(cls)).replace("_", "") != default.replace("_", "") or any(
            cfg.get(k) is not None for k in cfg if k != "seed"
        ):
            self.refuse(arg, cls, f"{default} (Keras' default)")

    def trainable(self) -> None:
        """A layer with weights: frozen (Keras' fine-tuning) is refused, not trained anyway."""
        v = self.take("trainable", True)
        if v is not True:
            self.refuse("trainable", v, "True: ringtrain trains every layer's weights")

    def nothing(self, *args: str) -> None:
        for a in args:
            v = self.take(a)
            if v is not None:
                self.refuse(a, v, "None")

    def channels_last(self) -> None:
        self.must_be("data_format", "channels_last", None)

    def done(self, supported: str) -> None:
        for k in self.IGNORED:
            self.cfg.pop(k, None)
        for k, v in self.cfg.items():
            self.refuse(k, v, f"the arguments {supported}")


def _conv(a: _Args) -> Conv2D:
    a.trainable()
    filters = a.take("filters")
    if not isinstance(filters, int) or filters < 1:
        a.refuse("filters", filters, "a positive int")
    spec = Conv2D(
        a.name,
        filters,
        a.pair("kernel_size", None),
        a.pair("strides", 1),
        _padding(a),
        a.activation(),
        bool(a.take("use_bias", True)),
    )
    a.channels_last()
    dilation = a.take("dilation_rate", 1)
    if dilation not in (1, [1, 1], (1, 1)):
        a.refuse("dilation_rate", dilation, "1")
    a.must_be("groups", 1)
    a.initializer("kernel_initializer", "glorot_uniform")
    a.initializer("bias_initializer", "zeros")
    a.nothing(
        "kernel_regularizer",
        "bias_regularizer",
        "activity_regularizer",
        "kernel_constraint",
        "bias_constraint",
        "lora_rank",
        "lora_alpha",
    )
    a.done("filters, kernel_size, strides, padding, activation, use_bias")
    return spec


def _padding(a: _Args) -> str:
    v = a.take("padding", "valid")
    if v not in ("valid", "same"):
        a.refuse("padding", v, "'valid' or 'same'")
    return v


def _pool(a: _Args) -> Pool2D:
    pool = a.pair("pool_size", 2)
    # checked like pool_size: a stride of 0 divided by zero at every reconcile (issue 20)
    strides = pool if a.cfg.get("strides") is None else a.pair("strides", None)
    a.take("strides")
    spec = Pool2D(a.name, "max" if a.cls == "MaxPooling2D" else "avg", pool, strides, _padding(a))
    a.channels_last()
    a.done("pool_size, strides, padding")
    return spec


def _dense(a: _Args) -> Dense:
    a.trainable()
    units = a.take("units")
    if not isinstance(units, int) or units < 1:
        a.refuse("units", units, "a positive int")
    spec = Dense(a.name, units, a.activation(), bool(a.take("use_bias", True)))
    a.initializer("kernel_initializer", "glorot_uniform")
    a.initializer("bias_initializer", "zeros")
    a.nothing(
        "kernel_regularizer",
        "bias_regularizer",
        "activity_regularizer",
        "kernel_constraint",
        "bias_constraint",
        "lora_rank",
        "lora_alpha",
        "quantization_config",
    )
    a.done("units, activation, use_bias")
    return spec


def _batchnorm(a: _Args) -> BatchNorm:
    a.trainable()
    a.must_be("axis", -1, 3, [-1], [3])
    spec = BatchNorm(
        a.name,
        float(a.take("momentum", 0.99)),
        float(a.take("epsilon", 1e-3)),
        bool(a.take("center", True)),
        bool(a.take("scale", True)),
    )
    for arg, default in (
        ("beta_initializer", "zeros"),
        ("gamma_initializer", "ones"),
        ("moving_mean_initializer", "zeros"),
        ("moving_variance_initializer", "ones"),
    ):
        a.initializer(arg, default)
    a.nothing(
        "beta_regularizer",
        "gamma_regularizer",
        "beta_constraint",
        "gamma_constraint",
        "renorm_clipping",
        "adjustment",
        "virtual_batch_size",
    )
    a.must_be("synchronized", False)
    a.must_be("renorm", False)
    a.must_be("fused", None, True, False)
    a.take("renorm_momentum")
    a.done("axis=-1, momentum, epsilon, center, scale")
    return spec


def _activation_layer(a: _Args):
    if a.cls == "Activation":
        spec = Activation(a.name, a.activation())
        a.done("activation")
    elif a.cls == "ReLU":
        a.nothing("max_value")
        a.must_be("negative_slope", 0.0, 0)
        a.must_be("threshold", 0.0, 0)
        spec = Activation(a.name, "relu", "ReLU")
        a.done("max_value=None, negative_slope=0, threshold=0")
    else:
        a.must_be("axis", -1, [-1])
        spec = Activation(a.name, "softmax", "Softmax")
        a.done("axis=-1")
    return spec


def _simple(a: _Args):
    if a.cls == "Flatten":
        a.channels_last()
        a.done("none")
        return Flatten(a.name)
    if a.cls == "GlobalAveragePooling2D":
        a.channels_last()
        a.must_be("keepdims", False)
        a.done("none")
        return GlobalAvgPool2D(a.name)
    if a.cls == "Reshape":
        t = a.take("target_shape")
        if not isinstance(t, (list, tuple)) or not all(isinstance(i, int) for i in t):
            a.refuse("target_shape", t, "a list of ints (-1 for one inferred axis)")
        a.done("target_shape")
        return Reshape(a.name, tuple(t))
    if a.cls == "Rescaling":
        scale, offset = a.take("scale", 1.0), a.take("offset", 0.0)
        if not all(isinstance(v, (int, float)) for v in (scale, offset)):
            a.refuse("scale", scale, "one number for every channel (and one offset)")
        a.done("scale, offset")
        return Rescaling(a.name, float(scale), float(offset))
    rate = a.take("rate")
    if not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        a.refuse("rate", rate, "a number in [0, 1)")
    a.nothing("noise_shape")
    a.take("seed")  # ringtrain's masks come from --seed, the step and the example
    a.done("rate")
    return Dropout(a.name, float(rate))


PARSERS = {
    "Conv2D": _conv,
    "MaxPooling2D": _pool,
    "AveragePooling2D": _pool,
    "Dense": _dense,
    "BatchNormalization": _batchnorm,
    "Activation": _activation_layer,
    "ReLU": _activation_layer,
    "Softmax": _activation_layer,
    "Flatten": _simple,
    "GlobalAveragePooling2D": _simple,
    "Reshape": _simple,
    "Rescaling": _simple,
    "Dropout": _simple,
}
SUPPORTED = ("InputLayer", *PARSERS)


def _input_shape(layer: dict) -> tuple[int, ...] | None:
    c = layer.get("config") or {}
    for key in ("batch_shape", "batch_input_shape"):
        if c.get(key) is not None:
            return tuple(c[key][1:])
    if c.get("input_shape") is not None:
        return tuple(c["input_shape"])
    return None


#: compile_config fields that only steer Keras' own loop (how many steps per call, eager or
#: XLA): they change no number ringtrain computes, so any value is accepted
COMPILE_EXECUTION = ("run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss")
#: metrics ringtrain reports itself, per kind of loss (loss and the metric on /status,
#: TensorBoard, the evaluator): accuracy for classification, MAE for regression
METRICS = {
    "sparse": ("accuracy", "acc", "sparse_categorical_accuracy"),
    "categorical": ("accuracy", "acc", "categorical_accuracy"),
    "binary": ("accuracy", "acc", "binary_accuracy"),
    "regression": ("mae", "mean_absolute_error"),
}


def _check_compile(comp: dict, kind: str) -> None:
    """Refuse, by field, compile settings ringtrain would otherwise ignore."""
    for k, v in comp.items():
        where = f"model: compile_config.{k}"
        if k in ("optimizer", "loss", *COMPILE_EXECUTION):
            continue
        if k in ("loss_weights", "weighted_metrics"):
            if v not in (None, [], {}):
                raise InvalidSpec(f"{where}={v!r} is not supported (supported: None)")
        elif k == "metrics":
            for m in v if isinstance(v, list) else [] if v is None else [v]:
                name = m.get("class_name") if isinstance(m, dict) else m
                if snake_case(str(name)) not in METRICS[kind]:
                    raise InvalidSpec(
                        f"{where}: metric {name!r} is not supported with a {kind} loss "
                        f"(ringtrain reports the loss and: {', '.join(METRICS[kind])})"
                    )
        else:
            raise InvalidSpec(f"{where}: this compile setting is not supported")


def parse(model: dict) -> ModelConfig:
    """Validate a Keras Sequential config (Keras 3 or tf.keras 2 ``to_json`` output)."""
    if not isinstance(model, dict) or model.get("class_name") != "Sequential":
        got = model.get("class_name") if isinstance(model, dict) else type(model).__name__
        raise InvalidSpec(
            f"model: a Keras Sequential config is needed, got {got!r} "
            "(functional and subclassed models are not supported)"
        )
    cfg = model.get("config") or {}
    if cfg.get("trainable", True) is not True:
        raise InvalidSpec(
            f"model: trainable={cfg['trainable']!r} is not supported "
            "(supported: True: ringtrain trains every layer's weights)"
        )
    layers = cfg.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidSpec("model: the Sequential config has no layers")
    input_shape = None
    for key in ("build_input_shape",):
        if cfg.get(key):
            input_shape = tuple(cfg[key][1:])
    specs = []
    for i, layer in enumerate(layers):
        cls = layer.get("class_name") if isinstance(layer, dict) else None
        if cls == "InputLayer":
            a = _Args(layer, i)
            input_shape = _input_shape(layer) or input_shape
            for k in (
                "batch_shape",
                "batch_input_shape",
                "input_shape",
                "sparse",
                "ragged",
                "optional",
                "batch_size",
                "input_tensor",
            ):
                v = a.take(k)
                if k in ("sparse", "ragged", "input_tensor") and v:
                    a.refuse(k, v, "False")
            a.done("shape")
            continue
        if cls not in PARSERS:
            name = (layer.get("config") or {}).get("name") if isinstance(layer, dict) else None
            raise InvalidSpec(
                f"model: layer {name or i!r} ({cls}) is not supported "
                f"(supported layers: {', '.join(SUPPORTED)})"
            )
        if not specs and input_shape is None:
            input_shape = _input_shape(layer)
        a = _Args(layer, i)
        for k in ("batch_input_shape", "input_shape", "batch_size"):
            a.take(k)
        specs.append(PARSERS[cls](a))
    if input_shape is None or any(not isinstance(d, int) or d < 1 for d in input_shape):
        raise InvalidSpec(
            f"model: the input shape {input_shape} must be known and fixed "
            "(give the model an InputLayer with shape=...)"
        )
    comp = model.get("compile_config") or {}
    loss = losses.parse(comp.get("loss"))
    tail = getattr(specs[-1], "activation", None) if specs else None
    if loss is None:  # no compile settings: sparse cross-entropy on what the model ends in
        loss = losses.LossSpec("SparseCategoricalCrossentropy", {"from_logits": tail != "softmax"})
    _check_compile(comp, loss.kind)
    loss = losses.fold(loss, tail)
    from_logits = bool(loss.arg("from_logits"))
    return ModelConfig(
        str(cfg.get("name") or "sequential"),
        input_shape,
        tuple(specs),
        from_logits,
        from_compile_config(model.get("compile_config")),
        loss,
    )
