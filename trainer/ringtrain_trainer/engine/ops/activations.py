"""Every Keras activation in common use, forward and backward side by side, in one table.

Why a table: an activation is used by Dense, the convolutions and the ``Activation`` layer
alike; one entry (``ACTIVATIONS[name]``) says how to compute it in place, how to compute its
gradient, and what that gradient reads — the output only (relu, sigmoid, tanh, elu, ...) or the
input too (gelu, swish, mish, ...). An op asks :meth:`Activation.buffers` for what to plan
(the pre-activation ``z`` where the input is read, scratch arrays) and calls :meth:`run` /
:meth:`grad`; nothing is allocated per step except row sums of the two softmaxes.

Definitions follow Keras 3 on its TensorFlow backend: ``gelu`` is exact (F.erf), ``gelu_tanh`` the
tanh approximation; ``swish`` = ``silu``, ``hard_swish`` = ``hard_silu`` = ``x * relu6(x + 3) / 6``,
``hard_sigmoid`` = ``relu6(x + 3) / 6``, ``selu`` with TensorFlow's constants, ``leaky_relu``
with Keras' default slope 0.2. Sigmoid is computed as ``(1 + tanh(x / 2)) / 2`` (no overflow).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activation_fns as F


@dataclass(frozen=True)
class Activation:
    """One activation: ``forward(x, out, tmp, **params)`` and ``backward(x, y, dy, dx, tmp,
    **params)``; ``needs_input``: backward reads the pre-activation (so an op keeps it in a
    ``z`` buffer; otherwise the activation runs in place on the output); ``scratch``: how many
    arrays shaped like the output it borrows (gelu's keeps ``F.erf`` and ``exp`` from forward to
    backward, so backward never recomputes F.erf)."""

    name: str
    forward: Callable
    backward: Callable
    needs_input: bool = False
    scratch: int = 0
    params: dict = field(default_factory=dict)

    @property
    def identity(self) -> bool:
        return self.forward is F.linear_f

    def buffers(self, shape: tuple[int, ...], train: bool) -> dict:
        """What an op plans for its activation: ``z`` (the pre-activation, where backward
        reads it), ``act0``.. (scratch), ``dz`` (the gradient through it, training only)."""
        bufs = {f"act{i}": (shape, "f") for i in range(self.scratch)}
        if self.needs_input:
            bufs["z"] = (shape, "f")
        if train and not self.identity:
            bufs["dz"] = (shape, "f")
        return bufs

    def pre(self, ws: Any) -> np.ndarray:
        """Where the op writes its pre-activation: ``z``, or ``out`` itself (in place)."""
        return ws["z"] if self.needs_input else ws["out"]

    def _tmp(self, ws: Any):
        if self.scratch == 0:
            return None
        return ws["act0"] if self.scratch == 1 else tuple(ws[f"act{i}"] for i in range(2))

    def run(self, ws: Any) -> np.ndarray:
        """Apply the activation to what :meth:`pre` holds; returns ``out``."""
        out = ws["out"]
        if not self.identity or self.needs_input:
            self.forward(self.pre(ws), out, self._tmp(ws), **self.params)
        return out

    def grad(self, ws: Any, dout: np.ndarray) -> np.ndarray:
        """The gradient with respect to the pre-activation (``dz``, or ``dout`` when linear).
        Called after :meth:`run` on the same input, as every op does (one forward, then its
        backward): gelu's gradient reads what its forward left in the scratch."""
        if self.identity:
            return dout.reshape(ws["out"].shape)
        dz = ws["dz"]
        x = ws["z"] if self.needs_input else None
        self.backward(x, ws["out"], dout.reshape(dz.shape), dz, self._tmp(ws), **self.params)
        return dz


def _entry(name, f, b, needs_input=False, scratch=0, **params) -> Activation:
    return Activation(name, f, b, needs_input, scratch, params)


#: Keras activation name → entry (parameters at Keras' defaults; :func:`get` overrides them)
ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        _entry("linear", F.linear_f, F.linear_b),
        _entry("relu", F.relu_f, F.relu_b),
        _entry("relu6", F.clip_f, F.clip_b, lo=0.0, hi=6.0),
        _entry("leaky_relu", F.leaky_f, F.leaky_b, scratch=1, negative_slope=0.2),
        _entry("elu", F.elu_f, F.elu_b, scratch=1, alpha=1.0),
        _entry("selu", F.elu_f, F.elu_b, scratch=1, alpha=F.SELU_ALPHA, scale=F.SELU_SCALE),
        _entry("celu", F.celu_f, F.celu_b, scratch=1, alpha=1.0),
        _entry("sigmoid", F.sigmoid_f, F.sigmoid_b),
        _entry("hard_sigmoid", F.clip_f, F.clip_b, lo=0.0, hi=6.0, shift=3.0, scale=1 / 6),
        _entry("hard_tanh", F.clip_f, F.clip_b, lo=-1.0, hi=1.0),
        _entry("tanh", F.tanh_f, F.tanh_b),
        _entry("exponential", F.exp_f, F.exp_b),
        _entry("softplus", F.softplus_f, F.softplus_b, scratch=1),
        _entry("log_sigmoid", F.log_sigmoid_f, F.log_sigmoid_b, scratch=1),
        _entry("softsign", F.softsign_f, F.softsign_b, scratch=1),
        _entry("silu", F.silu_f, F.silu_b, needs_input=True, scratch=1),
        _entry("hard_silu", F.hard_silu_f, F.hard_silu_b, needs_input=True, scratch=1),
        _entry("gelu", F.gelu_f, F.gelu_b, needs_input=True, scratch=2),
        _entry("gelu_tanh", F.gelu_tanh_f, F.gelu_tanh_b, needs_input=True, scratch=2),
        _entry("mish", F.mish_f, F.mish_b, needs_input=True, scratch=2),
        _entry("softmax", F.softmax_f, F.softmax_b),
        _entry("log_softmax", F.log_softmax_f, F.log_softmax_b, scratch=1),
    )
}
ALIASES = {"swish": "silu", "hard_swish": "hard_silu"}
#: the general ReLU (Keras' ``ReLU`` layer / ``relu(x, ...)`` with non-default arguments)
_RELU_GENERAL = _entry("relu", F.relu_general_f, F.relu_general_b, needs_input=True, scratch=2)
_RELU_DEFAULTS = {"negative_slope": 0.0, "max_value": None, "threshold": 0.0}


def get(name: str, **params) -> Activation:
    """The entry for a Keras activation name (or alias), its parameters overridden by
    ``params`` (``leaky_relu(negative_slope)``, ``elu(alpha)``, ``relu(negative_slope,
    max_value, threshold)``, ``gelu(approximate)``). Unknown names or arguments raise
    ``ValueError`` naming them."""
    name = ALIASES.get(name, name)
    if name == "gelu" and params.pop("approximate", False):
        name = "gelu_tanh"
    if name == "relu" and params:
        unknown = set(params) - set(_RELU_DEFAULTS)
        if unknown:
            raise ValueError(f"activation relu has no argument {sorted(unknown)}")
        p = {**_RELU_DEFAULTS, **params}
        if p["threshold"] < 0:
            raise ValueError("activation relu: threshold < 0 is not supported")
        if p == _RELU_DEFAULTS:
            return ACTIVATIONS["relu"]
        if not p["negative_slope"] and not p["threshold"]:
            return replace(
                ACTIVATIONS["relu6"], name="relu", params={"lo": 0.0, "hi": float(p["max_value"])}
            )
        return replace(_RELU_GENERAL, params=p)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported (supported: "
            f"{', '.join(sorted([*ACTIVATIONS, *ALIASES]))})"
        )
    entry = ACTIVATIONS[name]
    unknown = set(params) - set(entry.params)
    if unknown or set(params) & {"lo", "hi", "shift", "scale"}:
        raise ValueError(f"activation {name} has no argument {sorted(params)}")
    return replace(entry, params={**entry.params, **params}) if params else entry


def resolve(act: str | Activation) -> Activation:
    """An entry from a Keras activation name, or the entry itself."""
    return act if isinstance(act, Activation) else get(act)


class ActWs(TypedDict, total=False):
    """The buffers :class:`Act` is compiled with (``buffers``, its state, ``bind``)."""

    out: np.ndarray
    z: np.ndarray


class Act(Op):
    """An activation as an op of its own (Keras ``Activation``, ``ReLU``, ``LeakyReLU``,
    ``ELU``, ``Softmax``): the table's entry on a tensor of any shape. Where backward reads the
    input, the op keeps a reference to it (the producer's buffer, unchanged until backward)
    rather than a copy."""

    def __init__(self, shape, activation: str | Activation):
        self.in_shape = self.out_shape = tuple(shape)
        self.act = resolve(activation)

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, *self.out_shape), "f"), **self.act.buffers((b, *self.out_shape), train)}
        bufs.pop("z", None)
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (4 + 4 * train)

    def forward(self, ws: ActWs, x):
        if self.act.needs_input:
            ws["z"] = x.reshape(ws["out"].shape)
        else:
            np.copyto(ws["out"], x.reshape(ws["out"].shape))
        return self.act.run(ws)

    def backward_input(self, ws: ActWs, dout):
        return self.act.grad(ws, dout)


_CHECKED: dict = {}  # name -> table entry: the RNN cells look one up per timestep


def _in_place(name: str):
    entry = _CHECKED.get(name)
    if entry is not None:
        return entry
    entry = ACTIVATIONS[name]
    if entry.needs_input or entry.scratch:
        raise ValueError(f"activation {name!r} needs planned buffers: use the table's API")
    _CHECKED[name] = entry
    return entry


def act_forward(name: str, z: np.ndarray) -> None:
    """Apply an activation of ``engine.ops.activations`` that runs in place (relu, sigmoid,
    tanh, softmax, linear, ...) to ``z``."""
    _in_place(name).forward(z, z, None)


def act_backward(name: str, y: np.ndarray, dy: np.ndarray, dz: np.ndarray) -> None:
    """``dz = dy * activation'`` written into ``dz`` (not ``dy``), from the output ``y``."""
    _in_place(name).backward(None, y, dy, dz, None)
