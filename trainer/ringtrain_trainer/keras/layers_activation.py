"""Registry entries of the activation layers: ``Activation`` (every activation of
``engine.ops.activations``), ``ReLU`` (``max_value``, ``negative_slope``, ``threshold``:
MobileNet's ``ReLU(6.)``), ``LeakyReLU``, ``ELU`` and ``Softmax``. Each runs as
``engine.ops.activations.Act``; a final softmax or sigmoid is folded into the loss (the build
returns the identity). ``PReLU`` has a trainable slope: its own op (``engine/ops/prelu.py``)."""

from __future__ import annotations

from typing import Any

from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.engine.ops.prelu import PReLU
from ringtrain_trainer.keras import onnx_acts
from ringtrain_trainer.keras.entry import Args, Entry, Weight
from ringtrain_trainer.keras.layers_window import ACTS, _activation


def _number(a: Args, arg: str, default, low: float = 0.0):
    v = a.take(arg, default)
    if v is None and default is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or v < low:
        a.refuse(arg, v, f"a number ≥ {low}")
    return float(v)


def _parse(a: Args) -> dict:
    if a.cls == "Activation":
        args: dict[str, Any] = {"activation": _activation(a)}
    elif a.cls == "ReLU":
        args = {
            "max_value": _number(a, "max_value", None),
            "negative_slope": _number(a, "negative_slope", 0.0),
            "threshold": _number(a, "threshold", 0.0),
        }
    elif a.cls == "LeakyReLU":
        a.take("alpha")  # Keras 2's name, which Keras 3 still writes beside negative_slope
        args = {"negative_slope": _number(a, "negative_slope", 0.3)}
    elif a.cls == "ELU":
        args = {"alpha": _number(a, "alpha", 1.0)}
    else:
        a.must_be("axis", -1, [-1])
        args = {"axis": -1}
    a.done(", ".join(args))
    return args


def activation_of(args: dict) -> tuple[str, dict]:
    """(table name, its arguments) of a layer's normalized Keras arguments."""
    if "activation" in args:
        return args["activation"], {}
    if "axis" in args:
        return "softmax", {}
    if "alpha" in args:
        return "elu", {"alpha": args["alpha"]}
    if "max_value" in args:  # ReLU
        return "relu", {k: v for k, v in args.items() if v}
    return "leaky_relu", dict(args)


def _build(spec, shapes, ctx):
    name, params = activation_of(spec.args)
    if ctx.fold and name == ctx.fold:
        return None
    return activations.Act(shapes[0], activations.get(name, **params))


def _onnx(g, spec, weights) -> None:
    name, params = activation_of(spec.args)
    x = g.x(0, nchw=False if name in ("softmax", "log_softmax") else None)
    g.out(onnx_acts.act(g, x, name, params))


def _entry(doc: str) -> Entry:
    return Entry(_parse, _build, _onnx, activation=lambda args: activation_of(args)[0], doc=doc)


ENTRIES = {
    "Activation": _entry(ACTS),
    "ReLU": _entry("`max_value`, `negative_slope`, `threshold` (≥ 0)"),
    "LeakyReLU": _entry("`negative_slope`"),
    "ELU": _entry("`alpha`"),
    "Softmax": _entry("`axis=-1`"),
}


def _prelu_parse(a: Args) -> dict:
    axes = a.take("shared_axes")
    if axes is not None and (
        not isinstance(axes, list | tuple)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in axes)
    ):
        a.refuse("shared_axes", axes, "None or axes 1..rank (the batch axis is 0)")
    a.initializer("alpha_initializer", "zeros")
    a.nothing("alpha_regularizer", "alpha_constraint")
    a.done("shared_axes, alpha_initializer, alpha_regularizer, alpha_constraint")
    return {"shared_axes": None if axes is None else list(axes)}


def _alpha_shape(args: dict, shape: tuple) -> tuple[int, ...]:
    axes = args["shared_axes"] or []
    if any(i > len(shape) for i in axes):
        raise ValueError(f"shared_axes={axes} for an input of {len(shape)} axes")
    return tuple(1 if i + 1 in axes else n for i, n in enumerate(shape))


def _prelu_build(spec, shapes, ctx):
    return PReLU(shapes[0], _alpha_shape(spec.args, shapes[0]))


def _prelu_onnx(g, spec, weights) -> None:
    g.out(g.op("PRelu", [g.x(0, nchw=False), g.const(f"{spec.name}_alpha", weights[0])], spec.name))


ENTRIES["PReLU"] = Entry(
    _prelu_parse,
    _prelu_build,
    _prelu_onnx,
    weights=lambda args, shapes: [Weight("alpha", _alpha_shape(args, shapes[0]))],
    doc="`shared_axes`, `alpha_initializer` (any), `alpha_regularizer`, `alpha_constraint`: a "
    "trainable slope per position (shared along `shared_axes`)",
)
