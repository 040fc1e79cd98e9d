"""The ONNX side of the activation table and of 1-D layouts, for the registry's emitters.

Why here: ``engine.ops.activations`` is the numbers (numpy), this is the same table as ONNX
nodes (opset 17, so ``Gelu`` and ``Mish`` are written out from ``Erf`` / ``Softplus``).
"""

from __future__ import annotations

import math

import numpy as np

#: Keras activation names the engine runs (``engine.ops.activations`` plus its aliases)
NAMES = ("linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "sigmoid",
         "hard_sigmoid", "hard_tanh", "tanh", "exponential", "softplus", "log_sigmoid",
         "softsign", "silu", "swish", "hard_silu", "hard_swish", "gelu", "mish", "softmax",
         "log_softmax")  # fmt: skip
_SIMPLE = {"exponential": "Exp", "softplus": "Softplus", "softsign": "Softsign",
           "hard_silu": "HardSwish", "hard_swish": "HardSwish", "relu": "Relu",
           "sigmoid": "Sigmoid", "tanh": "Tanh"}  # fmt: skip


def _c(g, v: float) -> str:
    return g.const("c", np.asarray(v, np.float32))


def act(g, y: str, name: str, params: dict | None = None) -> str:
    """``name`` applied to ``y`` (either layout: the soft-maxes take the channel axis), with
    Keras' arguments ``params`` (``relu``'s, ``leaky_relu``'s slope, ``elu``'s alpha)."""
    h, p = f"{g.spec.name}_{name}", params or {}
    if name == "relu" and p and any(p.get(k) for k in ("negative_slope", "max_value", "threshold")):
        return _relu(g, y, h, **p)
    if name == "linear":
        return y
    if name in _SIMPLE:
        return g.op(_SIMPLE[name], [y], h)
    if name in ("softmax", "log_softmax"):
        op = "Softmax" if name == "softmax" else "LogSoftmax"
        return g.op(op, [y], h, axis=1 if g.nchw else -1)
    if name in ("relu6", "hard_tanh"):
        lo, hi = (0.0, 6.0) if name == "relu6" else (-1.0, 1.0)
        return g.op("Clip", [y, _c(g, lo), _c(g, hi)], h)
    if name == "leaky_relu":
        return g.op("LeakyRelu", [y], h, alpha=float(p.get("negative_slope", 0.2)))
    if name in ("elu", "celu"):
        return g.op(name.capitalize(), [y], h, alpha=float(p.get("alpha", 1.0)))
    if name == "selu":
        return g.op("Selu", [y], h, alpha=1.6732632423543772, gamma=1.0507009873554805)
    if name == "hard_sigmoid":
        return g.op("HardSigmoid", [y], h, alpha=1.0 / 6.0, beta=0.5)
    if name in ("silu", "swish"):
        return g.op("Mul", [y, g.op("Sigmoid", [y], f"{h}_s")], h)
    if name == "log_sigmoid":
        neg = g.op("Neg", [g.op("Softplus", [g.op("Neg", [y], f"{h}_n")], f"{h}_p")], h)
        return neg
    if name == "mish":
        th = g.op("Tanh", [g.op("Softplus", [y], f"{h}_p")], f"{h}_t")
        return g.op("Mul", [y, th], h)
    if name == "gelu":  # x (1 + erf(x / sqrt 2)) / 2
        e = g.op("Erf", [g.op("Mul", [y, _c(g, 1 / math.sqrt(2.0))], f"{h}_s")], f"{h}_e")
        half = g.op("Mul", [y, _c(g, 0.5)], f"{h}_h")
        return g.op("Mul", [half, g.op("Add", [e, _c(g, 1.0)], f"{h}_a")], h)
    raise ValueError(f"activation {name!r} has no ONNX form")


def _relu(g, y, h, negative_slope=0.0, max_value=None, threshold=0.0) -> str:
    """Keras' ``relu(x, negative_slope, max_value, threshold)``: ``min(x, max_value)`` above
    the threshold, ``negative_slope * (x - threshold)`` below."""
    pos = y if max_value is None else g.op("Min", [y, _c(g, max_value)], f"{h}_max")
    neg = g.op(
        "Mul", [g.op("Sub", [y, _c(g, threshold)], f"{h}_t"), _c(g, negative_slope)], f"{h}_n"
    )
    return g.op("Where", [g.op("Greater", [y, _c(g, threshold)], f"{h}_gt"), pos, neg], h)


def channels_first(g, spec) -> str:
    """The layer's input as ONNX's convolutions read it: NCHW, (N, C, L) for 1-D, (N, C, D, H,
    W) for 3-D."""
    r = len(spec.in_shapes[0])
    if r == 3:
        return g.x(0, nchw=True)
    x = g.x(0, nchw=False)
    return g.op("Transpose", [x], f"{spec.name}_ncl", perm=[0, r, *range(1, r)])


def channels_last(g, spec, y: str) -> str:
    """A 1-D or 3-D result back to channels last; a 2-D one stays NCHW (the writer tracks
    it)."""
    r = len(spec.in_shapes[0])
    if r == 3:
        g.nchw = True
        return y
    g.nchw = False
    return g.op("Transpose", [y], f"{spec.name}_nlc", perm=[0, *range(2, r + 1), 1])
