"""What one registry entry is, and the argument reader every entry's ``parse`` uses.

Why one record per Keras class: the trainer and the exporters used to read each layer's config
separately (≈11 edits in 5 files per new layer). An :class:`Entry` says, in one place, which
arguments the layer accepts (everything else is refused by name), its output shape from its
input shapes, its weights in ``get_weights()`` order, the engine op it becomes and its ONNX
nodes. Parsing and shape inference are pure Python; ``build`` and ``onnx`` import numpy and the
engine lazily, so the operator's spec check stays cheap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops import initializers as I
from ringtrain_trainer.engine.ops import regularizers as R
from ringtrain_trainer.engine.ranges import FINITE, NON_NEGATIVE, POSITIVE, Range
from ringtrain_trainer.optim import constraints as C

Shape = tuple[int, ...]
#: the activations every layer with an ``activation`` argument accepts
ACTIVATIONS = ("relu", "sigmoid", "tanh", "softmax", "linear")
ACTS_DOC = f"`activation` ({', '.join(ACTIVATIONS)})"
#: an initializer's arguments: a spread ≥ 0, a scale > 0, the rest finite (a negative stddev
#: or a string passed the spec check and crashed every worker when it drew the weights)
INIT_RANGES = {
    "stddev": NON_NEGATIVE,
    "scale": POSITIVE,
    "mean": FINITE,
    "minval": FINITE,
    "maxval": FINITE,
    "value": FINITE,
    "gain": FINITE,
}


@dataclass(frozen=True)
class Weight:
    """One array of a layer in ``get_weights()`` order; ``trainable`` False: non-trainable
    state (BatchNormalization's moving statistics), outside the flat parameter buffer."""

    name: str
    shape: Shape
    trainable: bool = True
    #: the Keras sub-layer holding it in ``model.weights.h5`` (an RNN's ``cell``, attention's
    #: ``query_dense``), "" for the layer's own ``vars``
    group: str = ""
    #: its dtype in the ``.keras`` file (Normalization's ``count`` is an int); held as float32
    dtype: str = "float32"


@dataclass(frozen=True)
class Build:
    """What a layer's ``build`` needs besides its own spec: its position among the model's
    layers (Dropout keys its masks on it) and the activation the loss computes itself
    (``softmax``/``sigmoid`` of the model's last layer, or None)."""

    index: int
    fold: str | None = None
    #: the Keras masks the node reads after its inputs (``keras.masks``): ``("input",)`` for
    #: an RNN or a pooling, the roles ("query", "value", "key") for attention; () none
    mask: tuple[str, ...] = ()


def _no_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    return []


def _activation(args: dict) -> str | None:
    return args.get("activation")


def without_folded(spec, fold: str | None):
    """The layer to build where the loss folds its ``activation`` argument away: the same
    layer with ``activation="linear"``. One rule for every layer with that argument, so that
    no entry's build can forget it (a ``Conv2D(..., activation="sigmoid")`` ending an
    autoencoder once applied the sigmoid twice). The ``Activation`` layer itself builds to
    nothing instead (``layers_activation``); the export keeps the layer as written."""
    if fold and spec.cls != "Activation" and spec.args.get("activation") == fold:
        return replace(spec, args={**spec.args, "activation": "linear"})
    return spec


def gamma_beta_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    """A normalization's ``gamma`` and ``beta`` over the last axis, where ``scale`` /
    ``center`` keep them, in Keras' ``get_weights()`` order."""
    c = (shapes[0][-1],)
    w = [Weight("gamma", c)] if args["scale"] else []
    return w + ([Weight("beta", c)] if args["center"] else [])


def same_shape(args: dict, shapes: list[Shape]) -> Shape:
    return shapes[0]


@dataclass(frozen=True)
class Entry:
    """Everything about one Keras layer class (see ``registry``'s docstring for an example).

    ``parse(a)`` consumes the config through :class:`Args` and returns the normalized Keras
    arguments (they are also what the exported config carries). ``infer(args, shapes)`` is the
    output shape (no batch axis) from the input shapes, raising ``ValueError`` with the reason
    when they do not fit. ``weights(args, shapes)`` lists the arrays in ``get_weights()`` order.
    ``build(spec, shapes, ctx)`` returns the engine op (``engine.op.Op`` protocol) or None
    for the identity. ``onnx(g, spec, weights)`` appends the layer's ONNX nodes to
    ``export.onnx_file``'s graph. ``inputs``: how many tensors it reads (0: two or more).
    ``doc``: the README's line for it (``python -m ringtrain_trainer.keras.registry``)."""

    parse: Callable[[Args], dict]
    build: Callable[..., Any]
    onnx: Callable[..., None]
    infer: Callable[[dict, list[Shape]], Shape] = same_shape
    weights: Callable[[dict, list[Shape]], list[Weight]] = _no_weights
    activation: Callable[[dict], str | None] = _activation
    #: (the arguments, the weight's own name) whose ``*_initializer``/``*_regularizer`` set a
    #: weight: the layer's own by default, a wrapped layer's for Bidirectional
    weight_args: Callable[[dict, str], tuple[dict, str]] = lambda args, weight: (args, weight)
    inputs: int = 1
    #: call arguments of a Functional node that ``parse`` reads like config arguments
    #: (MultiHeadAttention's ``use_causal_mask``); any other call argument is refused
    call_args: tuple[str, ...] = ()
    #: several inputs are separate positional call arguments (MultiHeadAttention's query,
    #: value, key), not one list (Add's)
    positional: bool = False
    #: whether the Keras class's constructor takes ``trainable`` (SpatialDropout's does not)
    takes_trainable: bool = True
    #: what the README's generated table says is supported (arguments, limits)
    doc: str = ""
    #: the module Keras deserializes the class from (a keras.applications layer's own)
    module: str = "keras.layers"


def snake_case(class_name: str) -> str:
    """Keras' ``naming.to_snake_case`` — how ``model.weights.h5`` names a layer's group."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def need_rank(spec, shape: Shape, rank: int, what: str) -> None:
    """A build's refusal of an input its engine op cannot take (the shape fits Keras)."""
    if len(shape) != rank:
        raise InvalidSpec(
            f"model: layer {spec.name!r} ({spec.cls}) got an input of shape {shape}; "
            f"it needs {what}"
        )


def window(n: int, k: int, s: int, padding: str) -> int:
    """Output length of a window of ``k`` at stride ``s`` ('same': ``ceil(n / s)``)."""
    return -(-n // s) if padding == "same" else (n - k) // s + 1


class Args:
    """One layer's config, consumed argument by argument; leftovers are refused.

    Arguments that only matter for Keras bookkeeping (``name``, ``trainable`` of a layer
    without weights, ``dtype`` float32) are accepted; every other argument must be one the
    entry takes, with a supported value — an unknown argument is refused rather than silently
    ignored."""

    IGNORED = ("name", "trainable", "dtype")

    def __init__(self, layer: dict, index: int):
        self.cls = layer.get("class_name", "?")
        self.cfg = dict(layer.get("config") or {})
        self.name = str(self.cfg.get("name") or layer.get("name") or f"layer {index}")
        self.where = f"layer {self.name!r} ({self.cls})"
        #: non-default initializers and the regularizers, by Keras argument: merged into the
        #: parsed arguments (``keras.config``), so the export writes them back
        self.extra: dict[str, Any] = {}
        dtype = self.cfg.get("dtype")
        if isinstance(dtype, dict):
            dtype = (dtype.get("config") or {}).get("name")
        if dtype not in (None, "float32", "mixed_float16"):  # the policy: keras.compile
            self.refuse("dtype", dtype, "float32 or mixed_float16")

    def refuse(self, arg: str, value: Any, supported: str) -> NoReturn:
        raise InvalidSpec(
            f"model: {self.where}: {arg}={value!r} is not supported (supported: {supported})"
        )

    def take(self, arg: str, default: Any = None) -> Any:
        return self.cfg.pop(arg, default)

    def must_be(self, arg: str, *allowed: Any) -> Any:
        v = self.take(arg, allowed[0])
        if v not in allowed:
            self.refuse(arg, v, " or ".join(repr(a) for a in allowed))
        return v

    def number(self, arg: str, default: Any, r: Range) -> float:
        """A numeric argument inside its meaningful range (``engine.ranges``), refused naming
        the argument and the range otherwise (a string, NaN or ``True`` included)."""
        v = self.take(arg, default)
        if r.fails(v):
            self.refuse(arg, v, r.text)
        return float(v)

    def positive(self, arg: str) -> int:
        v = self.take(arg)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            self.refuse(arg, v, "a positive int")
        return v

    def pair(self, arg: str, default: Any) -> list[int]:
        v = self.take(arg, default)
        v = [v, v] if isinstance(v, int) else list(v) if isinstance(v, (list, tuple)) else [v]
        if len(v) != 2 or not all(isinstance(i, int) and i >= 1 for i in v):
            self.refuse(arg, v, "a positive int or a pair of them")
        return v

    def activation(self, arg: str = "activation") -> str:
        v = self.take(arg, "linear")
        if isinstance(v, dict):  # a serialized function: {"class_name": "function", ...}
            v = v.get("config") if isinstance(v.get("config"), str) else v.get("class_name")
        v = "linear" if v is None else v
        if v not in ACTIVATIONS:
            self.refuse(arg, v, ", ".join(ACTIVATIONS))
        return v

    def initializer(self, arg: str, default: str | None = None) -> None:
        """Any initializer ``engine.ops.initializers`` knows. One that the parameter's
        ``glorot``/``ones`` flags do not describe (not Keras' ``default`` or a default such as
        LSTM's Orthogonal) is kept in :attr:`extra`: fresh weights draw from it and the export
        carries it back."""
        v = self.take(arg)
        flagged = default is not None and I.parse(default).name in (
            "GlorotUniform",
            "Zeros",
            "Ones",
        )
        if v is None and flagged:
            return
        v = default if v is None else v
        try:
            got = I.parse(v, arg)
        except (ValueError, TypeError) as e:
            self.refuse(arg, v, f"{', '.join(I.SUPPORTED)} ({e})")
        for k, x in got.args.items():
            r = INIT_RANGES.get(k)
            if r is not None and r.fails(x):
                self.refuse(f"{arg}.config.{k}", x, f"{r.text} for {got.name}")
        if got.args.get("minval", -0.05) > got.args.get("maxval", 0.05):
            self.refuse(f"{arg}.config.minval", got.args["minval"], "at most maxval")
        if not flagged or I.full(got) != I.full(I.parse(default)):
            self.extra[arg] = v

    def regularizer(self, arg: str) -> None:
        """Keras' ``L1``/``L2``/``L1L2`` (or ``"l1"``/``"l2"``), kept in :attr:`extra` in the
        serialized form Keras reloads; the trainer adds its penalty (``KerasModel``)."""
        v = self.take(arg)
        try:
            reg = R.parse(v, arg)
        except (ValueError, TypeError) as e:
            self.refuse(arg, v, f"L1, L2, L1L2 ({e})")
        if reg is not None and (NON_NEGATIVE.fails(reg.l1) or NON_NEGATIVE.fails(reg.l2)):
            self.refuse(arg, v, f"L1, L2, L1L2 with l1 and l2 each {NON_NEGATIVE.text}")
        if reg is not None:
            self.extra[arg] = R.keras(reg)

    def activity(self) -> None:
        """Any layer's ``activity_regularizer`` (``L1``/``L2``/``L1L2``), kept in
        :attr:`extra` like a weight regularizer; the op is wrapped in
        ``engine.ops.activity.WithActivity`` (``keras_model``). A layer nested in a wrapper
        (TimeDistributed, Bidirectional) is not read here and still refuses it."""
        if self.cfg.get("activity_regularizer") is not None:
            self.regularizer("activity_regularizer")
        else:
            self.take("activity_regularizer")

    def constraint(self, arg: str) -> None:
        """Keras' ``MaxNorm``/``NonNeg``/``UnitNorm``/``MinMaxNorm``, kept in :attr:`extra`
        in the serialized form Keras reloads; the optimizer projects the weight after each
        update (``optim.constraints``)."""
        v = self.take(arg)
        try:
            c = C.parse(v, arg)
        except ValueError as e:
            self.refuse(arg, v, f"{', '.join(C.SUPPORTED)} ({e})")
        if c is not None:
            self.extra[arg] = C.keras(c)

    def trainable(self) -> None:
        """A layer with weights: ``trainable=False`` (Keras' fine-tuning) is kept in
        :attr:`extra`, so the layer's op runs frozen (``engine.ops.frozen``) and the export
        writes it back."""
        v = self.take("trainable", True)
        if v is False:
            self.extra["trainable"] = False
        elif v is not True:
            self.refuse("trainable", v, "True or False")

    def nothing(self, *args: str) -> None:
        """Arguments that must be absent; a weight regularizer or constraint among them is read
        instead (:meth:`regularizer`, :meth:`constraint`), so every layer with weights takes
        them in one place."""
        for a in args:
            if a.endswith("_regularizer") and a != "activity_regularizer":
                self.regularizer(a)
                continue
            if a.endswith("_constraint"):
                self.constraint(a)
                continue
            v = self.take(a)
            if v is not None:
                self.refuse(a, v, "None")

    def channels_last(self) -> str:
        self.must_be("data_format", "channels_last", None)
        return "channels_last"

    def done(self, supported: str) -> None:
        for k in self.IGNORED:
            self.cfg.pop(k, None)
        for k, v in self.cfg.items():
            self.refuse(k, v, f"the arguments {supported}")
