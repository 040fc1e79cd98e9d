"""The loss registry: Keras class name → one entry (its string aliases, kind and accepted
arguments), parsed from ``compile_config.loss`` into a :class:`LossSpec` before anything runs.

Apart from ``engine.losses`` (the values and gradients that run) because the spec is what the
front end, the data checks, the checkpoint and the memory plan all read, and none of them
needs the numerics. ``keras.compile.read`` calls :func:`parse` (refusing what is unsupported,
naming the field) and :func:`fold` (the final softmax/sigmoid folded into the loss, as Keras'
TensorFlow backend reads its ``_keras_logits``). Pure Python.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ringtrain.errors import InvalidSpec

WHERE = "compile_config.loss"

#: Keras class name → (its string aliases, kind, the accepted config keys and their defaults)
_ENTRIES: dict[str, tuple[tuple[str, ...], str, dict]] = {
    "SparseCategoricalCrossentropy": (
        ("sparse_categorical_crossentropy",),
        "sparse",
        {"from_logits": False, "ignore_class": None},
    ),
    "CategoricalCrossentropy": (
        ("categorical_crossentropy",),
        "categorical",
        {"from_logits": False, "label_smoothing": 0.0, "axis": -1},
    ),
    "BinaryCrossentropy": (
        ("binary_crossentropy",),
        "binary",
        {"from_logits": False, "label_smoothing": 0.0, "axis": -1},
    ),
    "MeanSquaredError": (("mean_squared_error", "mse"), "regression", {}),
    "MeanAbsoluteError": (("mean_absolute_error", "mae"), "regression", {}),
    "Huber": (("huber", "huber_loss"), "regression", {"delta": 1.0}),
    # engine.loss_fns: value and gradient of each, Keras' epsilons
    "Poisson": (("poisson",), "regression", {}),
    "LogCosh": (("log_cosh", "logcosh"), "regression", {}),
    "KLDivergence": (("kl_divergence", "kld", "kullback_leibler_divergence"), "regression", {}),
    "MeanSquaredLogarithmicError": (("mean_squared_logarithmic_error", "msle"), "regression", {}),
    "MeanAbsolutePercentageError": (("mean_absolute_percentage_error", "mape"), "regression", {}),
    "Hinge": (("hinge",), "regression", {}),
    "SquaredHinge": (("squared_hinge",), "regression", {}),
    "CategoricalHinge": (("categorical_hinge",), "regression", {}),
    "CosineSimilarity": (("cosine_similarity",), "regression", {"axis": -1}),
}
SUPPORTED = tuple(_ENTRIES)
#: config keys every Keras loss has that change no number ringtrain computes
_BOOKKEEPING = ("name", "dtype")
REDUCTIONS = ("sum_over_batch_size", "auto", None)


def _snake(name: str) -> str:
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


_ALIASES = {a: cls for cls, (aliases, _, _) in _ENTRIES.items() for a in aliases}


@dataclass(frozen=True)
class LossSpec:
    """A validated loss: its Keras class name and arguments (``from_logits`` as compiled;
    ``folded``: the activation the loss reads through, folded away from the model;
    ``out_shape``: the output's shape per example where it is not flat, ``(*positions,
    width)`` — a loss per timestep or pixel, over the last axis at every position, as Keras)."""

    name: str = "SparseCategoricalCrossentropy"
    args: dict = field(default_factory=dict)
    folded: str | None = None
    out_shape: tuple[int, ...] = ()

    @property
    def positions(self) -> int:
        """Rows per example the loss reads: 1 for a flat output, else every position."""
        return math.prod(self.out_shape[:-1]) if self.out_shape else 1

    @property
    def kind(self) -> str:
        """``sparse``, ``categorical``, ``binary`` or ``regression``."""
        return _ENTRIES[self.name][1]

    def arg(self, key: str):
        return self.args.get(key, _ENTRIES[self.name][2].get(key))

    @property
    def metric(self) -> str:
        """What the evaluators report beside the loss."""
        return "mae" if self.kind == "regression" else "accuracy"

    def describe(self) -> str:
        """``CategoricalCrossentropy(from_logits=False, label_smoothing=0.1)`` for the log;
        a loss per position says over which positions (``... per position of (20,)``)."""
        args = {k: self.arg(k) for k in _ENTRIES[self.name][2] if k != "axis"}
        text = f"{self.name}({', '.join(f'{k}={v}' for k, v in args.items())})"
        if self.positions > 1:
            text += f" per position of {self.out_shape[:-1]}"
        return text

    def keras(self) -> dict:
        """The Keras serialization (``compile_config.loss``)."""
        cfg = {"name": _ENTRIES[self.name][0][0], "reduction": "sum_over_batch_size"}
        cfg.update({k: self.arg(k) for k in _ENTRIES[self.name][2]})
        return {"module": "keras.losses", "class_name": self.name, "config": cfg,
                "registered_name": None}  # fmt: skip

    def record(self) -> dict:
        """What ``/status`` and the checkpoint keep: the Keras serialization and the summary."""
        return {"keras": self.keras(), "describe": self.describe()}


#: what runs without compile settings (the presets): sparse cross-entropy from logits
DEFAULT = LossSpec("SparseCategoricalCrossentropy", {"from_logits": True})


def parse(doc) -> LossSpec | None:
    """``compile_config.loss`` (a string alias, a class name, ``{"class_name", "config"}``, or
    a loss function as Keras serializes one) → :class:`LossSpec`; None where there is none.
    Unsupported values raise naming the field."""
    if doc is None:
        return None
    if isinstance(doc, str):
        cls = _ALIASES.get(doc) or _ALIASES.get(_snake(doc)) or (doc if doc in _ENTRIES else None)
        if cls is None:
            raise InvalidSpec(
                f"model: {WHERE}={doc!r} is not supported (supported: {', '.join(SUPPORTED)} "
                "or their snake_case names)"
            )
        return LossSpec(cls)
    if not isinstance(doc, dict):
        raise InvalidSpec(f"model: {WHERE}={doc!r} is not supported (one loss, by name or class)")
    if doc.get("class_name") == "function" and isinstance(doc.get("config"), str):
        return parse(doc["config"])  # compile(loss=keras.losses.mean_squared_error)
    cls = doc.get("class_name")
    if cls not in _ENTRIES:
        cls = _ALIASES.get(str(cls))
    if cls is None:
        raise InvalidSpec(
            f"model: {WHERE}.class_name={doc.get('class_name')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    known = _ENTRIES[cls][2]
    args: dict[str, object] = {}
    for k, v in (doc.get("config") or {}).items():
        at = f"model: {WHERE}.config.{k}={v!r}"
        if k in _BOOKKEEPING:
            continue
        if k == "reduction":
            if v not in REDUCTIONS:
                raise InvalidSpec(f"{at} is not supported (supported: 'sum_over_batch_size')")
        elif k not in known:
            raise InvalidSpec(f"model: {WHERE}.config.{k}: {cls} argument not supported")
        elif k == "axis":
            if v not in (-1, None):
                raise InvalidSpec(f"{at} is not supported (supported: -1)")
        elif k == "from_logits":
            args[k] = bool(v)
        elif k == "ignore_class":
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise InvalidSpec(f"{at} is not supported (supported: None or a class id)")
            args[k] = v
        elif k == "label_smoothing":
            if not isinstance(v, int | float) or not 0 <= v <= 1:
                raise InvalidSpec(f"{at} is not supported (supported: 0 to 1)")
            args[k] = float(v)
        elif k == "delta":
            if not isinstance(v, int | float) or v <= 0:
                raise InvalidSpec(f"{at} is not supported (supported: a positive number)")
            args[k] = float(v)
    return LossSpec(cls, args)


def fold(spec: LossSpec, last_activation: str | None) -> LossSpec:
    """The activation folded into the loss (``softmax`` / ``sigmoid``), or a refusal where a
    probability loss would read something that is not one."""
    need = {"sparse": "softmax", "categorical": "softmax", "binary": "sigmoid"}.get(spec.kind)
    if need is None:
        return spec
    if last_activation == need:
        return LossSpec(spec.name, spec.args, need, spec.out_shape)
    other = "sigmoid" if need == "softmax" else "softmax"
    if last_activation == other:
        # Keras' TensorFlow backend would read the other activation's input as its logits
        raise InvalidSpec(
            f"model: {WHERE} {spec.name} on a model whose last layer is a {other}: Keras "
            f"computes it from the {other}'s input, not its output (supported: a {need} "
            "ending, or a linear one with from_logits=True)"
        )
    if not spec.arg("from_logits"):
        raise InvalidSpec(
            f"model: {WHERE} {spec.name} with from_logits=False needs a model whose last layer "
            f"is a {need} (supported: a {need} ending, or from_logits=True)"
        )
    return spec
