"""Every Keras activation in common use, forward and backward side by side, in one table.

Why a table: an activation is used by Dense, the convolutions and the ``Activation`` layer
alike; one entry (``ACTIVATIONS[name]``) says how to compute it in place, how to compute its
gradient, and what that gradient reads — the output only (relu, sigmoid, tanh, elu, ...) or the
input too (gelu, swish, mish, ...). An op asks :meth:`Activation.buffers` for what to plan
(the pre-activation ``z`` where the input is read, scratch arrays) and calls :meth:`run` /
:meth:`grad`; nothing is allocated per step except row sums of the two softmaxes.

Definitions follow Keras 3 on its TensorFlow backend: ``gelu`` is exact (erf), ``gelu_tanh`` the
tanh approximation; ``swish`` = ``silu``, ``hard_swish`` = ``hard_silu`` = ``x * relu6(x + 3) / 6``,
``hard_sigmoid`` = ``relu6(x + 3) / 6``, ``selu`` with TensorFlow's constants, ``leaky_relu``
with Keras' default slope 0.2. Sigmoid is computed as ``(1 + tanh(x / 2)) / 2`` (no overflow).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ringtrain_trainer.engine.op import Op

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
#: erfc(z) = t exp(-z² + P(2t - 1)), t = 2 / (2 + z), z ≥ 0: a degree-20 fit (error < 3e-13)
_ERFC = (-0.6717940840567023, 0.6726432239781291, 0.04734330684464927, -0.0468956102704072,
         -0.009872689494060801, 0.008824939538553265, 0.0017589357895937815,
         -0.0023458239687429864, -0.00014626614689912013, 0.0006737539207982816,
         -9.364186574094044e-05, -0.0001746051977455762, 7.113649149203178e-05,
         3.2525461785744996e-05, -2.975247380976475e-05, -1.1680637347895809e-06,
         8.202943747924875e-06, -1.5647734674582796e-06, -1.2493501976861678e-06,
         3.914849410209308e-07, 3.9208021590664886e-08)  # fmt: skip
#: the same form for float32: degree 12, error < 6e-9 (float32's rounding is 6e-8; issue 24)
_ERFC32 = (-0.6717940851516006, 0.6726431547748186, 0.04734341751090632,
           -0.04689364056635173, -0.009874534782860604, 0.008808825410198028,
           0.001770665468717862, -0.0022887653434233886, -0.00018278074926631317,
           0.0005737664883898164, -3.211513367482771e-05, -8.72838567410807e-05,
           1.3371998496026153e-05)  # fmt: skip


def erf(x: np.ndarray, out: np.ndarray, tmp: np.ndarray, scale: float = 1.0) -> None:
    """``out = erf(scale * x)`` without allocating (numpy has no erf); ``tmp`` is left
    holding ``exp(-(scale * x)²)``, which gelu's gradient reads. float32 uses the degree-12
    fit (``_ERFC32``): its error is below float32's rounding, in 39 array passes, not 57."""
    coefs = _ERFC if x.dtype == np.float64 else _ERFC32
    np.abs(x, out=out)
    np.multiply(out, scale, out=out)
    np.add(out, 2.0, out=out)
    np.divide(4.0, out, out=tmp)
    np.subtract(tmp, 1.0, out=tmp)  # u = 2t - 1
    np.multiply(tmp, coefs[-1], out=out)
    np.add(out, coefs[-2], out=out)
    for c in coefs[-3::-1]:
        np.multiply(out, tmp, out=out)
        np.add(out, c, out=out)
    np.exp(out, out=out)
    np.add(tmp, 1.0, out=tmp)
    np.multiply(tmp, 0.5, out=tmp)  # t
    np.multiply(out, tmp, out=out)
    np.multiply(x, x, out=tmp)
    np.multiply(tmp, -scale * scale, out=tmp)
    np.exp(tmp, out=tmp)
    np.multiply(out, tmp, out=out)  # erfc(|scale x|)
    np.subtract(1.0, out, out=out)
    np.copysign(out, x, out=out)


def _sigmoid(x, out):
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    np.add(out, 1.0, out=out)
    np.multiply(out, 0.5, out=out)


def _softplus(x, out, tmp):
    """``out = log(1 + exp(x))``, stable; ``out`` may be ``x``."""
    np.abs(x, out=tmp)
    np.negative(tmp, out=tmp)
    np.exp(tmp, out=tmp)
    np.log1p(tmp, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)


# -- forward (x, out, tmp, **params) and backward (x, y, dy, dx, tmp, **params) -------------
# ``out`` is ``x`` itself unless the entry reads its input; ``dx`` never aliases the others.


def _linear_f(x, out, tmp):
    if out is not x:
        np.copyto(out, x)


def _linear_b(x, y, dy, dx, tmp):
    np.copyto(dx, dy)


def _relu_f(x, out, tmp):
    np.maximum(x, 0, out=out)


def _relu_b(x, y, dy, dx, tmp):
    np.greater(y, 0, out=dx)
    np.multiply(dx, dy, out=dx)


def _clip_f(x, out, tmp, lo, hi, shift=0.0, scale=1.0):
    """``clip(x + shift, lo, hi) * scale``: relu6, hard_sigmoid, hard_tanh, relu(max_value)."""
    np.add(x, shift, out=out)
    np.clip(out, lo, hi, out=out)
    if scale != 1.0:
        np.multiply(out, scale, out=out)


def _clip_b(x, y, dy, dx, tmp, lo, hi, shift=0.0, scale=1.0):
    mid, half = (lo + hi) * 0.5 * scale, (hi - lo) * 0.5 * scale
    np.subtract(y, mid, out=dx)
    np.abs(dx, out=dx)
    np.less(dx, half, out=dx)  # strictly inside the window
    np.multiply(dx, scale, out=dx)
    np.multiply(dx, dy, out=dx)


def _relu_general_f(x, out, tmp, negative_slope, max_value, threshold):
    """Keras ``relu(x, negative_slope, max_value, threshold)`` (threshold ≥ 0):
    ``min(x, max_value)`` above the threshold, ``negative_slope * (x - threshold)`` below."""
    t0, t1 = tmp
    np.greater(x, threshold, out=t0)
    if max_value is None:
        np.copyto(out, x)
    else:
        np.minimum(x, max_value, out=out)
    np.multiply(out, t0, out=out)
    np.subtract(x, threshold, out=t1)
    np.multiply(t1, negative_slope, out=t1)
    np.subtract(1.0, t0, out=t0)
    np.multiply(t1, t0, out=t1)
    np.add(out, t1, out=out)


def _relu_general_b(x, y, dy, dx, tmp, negative_slope, max_value, threshold):
    t0, _ = tmp
    np.greater(x, threshold, out=t0)
    if max_value is None:
        dx.fill(1.0)
    else:
        np.less(x, max_value, out=dx)
    np.multiply(dx, t0, out=dx)
    np.subtract(1.0, t0, out=t0)
    np.multiply(t0, negative_slope, out=t0)
    np.add(dx, t0, out=dx)
    np.multiply(dx, dy, out=dx)


def _leaky_f(x, out, tmp, negative_slope):
    np.multiply(x, negative_slope, out=tmp)
    (np.maximum if negative_slope <= 1 else np.minimum)(x, tmp, out=out)


def _leaky_b(x, y, dy, dx, tmp, negative_slope):
    np.greater(y, 0, out=dx)
    np.multiply(dx, 1.0 - negative_slope, out=dx)
    np.add(dx, negative_slope, out=dx)
    np.multiply(dx, dy, out=dx)


def _elu_f(x, out, tmp, alpha, scale=1.0):
    """``scale * (x if x > 0 else alpha * (exp(x) - 1))``: elu, and selu with its constants."""
    np.minimum(x, 0, out=tmp)
    np.expm1(tmp, out=tmp)
    np.multiply(tmp, alpha, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)
    if scale != 1.0:
        np.multiply(out, scale, out=out)


def _elu_b(x, y, dy, dx, tmp, alpha, scale=1.0):
    # scale above 0, y + scale alpha below: [y > 0] (scale - scale alpha) + min(y, 0) + scale alpha
    np.greater(y, 0, out=dx)
    np.multiply(dx, scale - scale * alpha, out=dx)
    np.minimum(y, 0, out=tmp)
    np.add(dx, tmp, out=dx)
    np.add(dx, scale * alpha, out=dx)
    np.multiply(dx, dy, out=dx)


def _celu_f(x, out, tmp, alpha):
    np.minimum(x, 0, out=tmp)
    np.multiply(tmp, 1.0 / alpha, out=tmp)
    np.expm1(tmp, out=tmp)
    np.multiply(tmp, alpha, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)


def _celu_b(x, y, dy, dx, tmp, alpha):
    np.minimum(y, 0, out=dx)  # exp(x / alpha) = y / alpha + 1 below zero, 1 above
    np.multiply(dx, 1.0 / alpha, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, dy, out=dx)


def _sigmoid_f(x, out, tmp):
    _sigmoid(x, out)


def _sigmoid_b(x, y, dy, dx, tmp):
    np.subtract(1.0, y, out=dx)
    np.multiply(dx, y, out=dx)
    np.multiply(dx, dy, out=dx)


def _tanh_f(x, out, tmp):
    np.tanh(x, out=out)


def _tanh_b(x, y, dy, dx, tmp):
    np.multiply(y, y, out=dx)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def _exp_f(x, out, tmp):
    np.exp(x, out=out)


def _exp_b(x, y, dy, dx, tmp):
    np.multiply(y, dy, out=dx)


def _softplus_f(x, out, tmp):
    _softplus(x, out, tmp)


def _softplus_b(x, y, dy, dx, tmp):
    np.negative(y, out=dx)  # sigmoid(x) = 1 - exp(-y)
    np.exp(dx, out=dx)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def _log_sigmoid_f(x, out, tmp):
    np.negative(x, out=out)
    _softplus(out, out, tmp)
    np.negative(out, out=out)


def _log_sigmoid_b(x, y, dy, dx, tmp):
    np.exp(y, out=dx)  # sigmoid(-x) = 1 - exp(y)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def _softsign_f(x, out, tmp):
    np.abs(x, out=tmp)
    np.add(tmp, 1.0, out=tmp)
    np.divide(x, tmp, out=out)


def _softsign_b(x, y, dy, dx, tmp):
    np.abs(y, out=dx)  # 1 / (1 + |x|) = 1 - |y|
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def _silu_f(x, out, tmp):
    _sigmoid(x, tmp)
    np.multiply(x, tmp, out=out)


def _silu_b(x, y, dy, dx, tmp):
    _sigmoid(x, tmp)  # s (1 + x (1 - s))
    np.subtract(1.0, tmp, out=dx)
    np.multiply(dx, x, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def _hard_silu_f(x, out, tmp):
    np.add(x, 3.0, out=out)
    np.clip(out, 0.0, 6.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 1.0 / 6.0, out=out)


def _hard_silu_b(x, y, dy, dx, tmp):
    np.multiply(x, 1.0 / 3.0, out=dx)  # (2x + 3) / 6 inside (-3, 3), 1 above, 0 below
    np.add(dx, 0.5, out=dx)
    np.abs(x, out=tmp)
    np.less(tmp, 3.0, out=tmp)
    np.multiply(dx, tmp, out=dx)
    np.greater_equal(x, 3.0, out=tmp)
    np.add(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def _gelu_f(x, out, tmp):
    """Keeps ``erf(x/√2)`` and ``exp(-x²/2)`` in the scratch for :func:`_gelu_b`."""
    erf(x, tmp[0], tmp[1], 1.0 / math.sqrt(2.0))
    np.add(tmp[0], 1.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 0.5, out=out)


def _gelu_b(x, y, dy, dx, tmp):
    """``Φ(x) + x φ(x)`` from what :func:`_gelu_f` left in the scratch (no second erf)."""
    np.add(tmp[0], 1.0, out=dx)
    np.multiply(dx, 0.5, out=dx)
    tmp = tmp[1]
    np.multiply(tmp, x, out=tmp)
    np.multiply(tmp, 1.0 / math.sqrt(2.0 * math.pi), out=tmp)
    np.add(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def _gelu_tanh_inner(x, t):
    """``t = tanh(sqrt(2/pi) (x + 0.044715 x³))``."""
    np.multiply(x, x, out=t)
    np.multiply(t, 0.044715, out=t)
    np.add(t, 1.0, out=t)
    np.multiply(t, x, out=t)
    np.multiply(t, _SQRT_2_PI, out=t)
    np.tanh(t, out=t)


def _gelu_tanh_f(x, out, tmp):
    _gelu_tanh_inner(x, tmp[0])
    np.add(tmp[0], 1.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 0.5, out=out)


def _gelu_tanh_b(x, y, dy, dx, tmp):
    th, t1 = tmp  # 0.5 (1 + th) + 0.5 x (1 - th²) k (1 + 3 c x²)
    _gelu_tanh_inner(x, th)
    np.multiply(x, x, out=dx)
    np.multiply(dx, 3 * 0.044715, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, x, out=dx)
    np.multiply(dx, 0.5 * _SQRT_2_PI, out=dx)
    np.multiply(th, th, out=t1)
    np.subtract(1.0, t1, out=t1)
    np.multiply(dx, t1, out=dx)
    np.add(th, 1.0, out=t1)
    np.multiply(t1, 0.5, out=t1)
    np.add(dx, t1, out=dx)
    np.multiply(dx, dy, out=dx)


def _mish_f(x, out, tmp):
    t = tmp[0]
    _softplus(x, t, out)
    np.tanh(t, out=t)
    np.multiply(x, t, out=out)


def _mish_b(x, y, dy, dx, tmp):
    th, t1 = tmp  # th + x (1 - th²) sigmoid(x), th = tanh(softplus(x))
    _softplus(x, th, t1)
    np.tanh(th, out=th)
    _sigmoid(x, dx)
    np.multiply(dx, x, out=dx)
    np.multiply(th, th, out=t1)
    np.subtract(1.0, t1, out=t1)
    np.multiply(dx, t1, out=dx)
    np.add(dx, th, out=dx)
    np.multiply(dx, dy, out=dx)


def _rows(a):
    return a.reshape(-1, a.shape[-1])


def _softmax_f(x, out, tmp):
    z = _rows(out)
    np.subtract(_rows(x), _rows(x).max(axis=1, keepdims=True), out=z)
    np.exp(z, out=z)
    np.divide(z, z.sum(axis=1, keepdims=True), out=z)


def _softmax_b(x, y, dy, dx, tmp):
    y2, dy2 = _rows(y), _rows(dy)
    s = np.einsum("ij,ij->i", y2, dy2)[:, None]
    np.subtract(dy2, s, out=_rows(dx))
    np.multiply(dx, y, out=dx)


def _log_softmax_f(x, out, tmp):
    z, e = _rows(out), _rows(tmp)
    np.subtract(_rows(x), _rows(x).max(axis=1, keepdims=True), out=z)
    np.exp(z, out=e)
    lse = e.sum(axis=1, keepdims=True)
    np.log(lse, out=lse)
    np.subtract(z, lse, out=z)


def _log_softmax_b(x, y, dy, dx, tmp):
    np.exp(y, out=dx)  # dy - softmax(x) * sum(dy)
    np.multiply(_rows(dx), _rows(dy).sum(axis=1, keepdims=True), out=_rows(dx))
    np.subtract(dy, dx, out=dx)


@dataclass(frozen=True)
class Activation:
    """One activation: ``forward(x, out, tmp, **params)`` and ``backward(x, y, dy, dx, tmp,
    **params)``; ``needs_input``: backward reads the pre-activation (so an op keeps it in a
    ``z`` buffer; otherwise the activation runs in place on the output); ``scratch``: how many
    arrays shaped like the output it borrows (gelu's keeps ``erf`` and ``exp`` from forward to
    backward, so backward never recomputes erf)."""

    name: str
    forward: Callable
    backward: Callable
    needs_input: bool = False
    scratch: int = 0
    params: dict = field(default_factory=dict)

    @property
    def identity(self) -> bool:
        return self.forward is _linear_f

    def buffers(self, shape: tuple[int, ...], train: bool) -> dict:
        """What an op plans for its activation: ``z`` (the pre-activation, where backward
        reads it), ``act0``.. (scratch), ``dz`` (the gradient through it, training only)."""
        bufs = {f"act{i}": (shape, "f") for i in range(self.scratch)}
        if self.needs_input:
            bufs["z"] = (shape, "f")
        if train and not self.identity:
            bufs["dz"] = (shape, "f")
        return bufs

    def pre(self, ws: dict) -> np.ndarray:
        """Where the op writes its pre-activation: ``z``, or ``out`` itself (in place)."""
        return ws["z"] if self.needs_input else ws["out"]

    def _tmp(self, ws):
        if self.scratch == 0:
            return None
        return ws["act0"] if self.scratch == 1 else tuple(ws[f"act{i}"] for i in range(2))

    def run(self, ws: dict) -> np.ndarray:
        """Apply the activation to what :meth:`pre` holds; returns ``out``."""
        out = ws["out"]
        if not self.identity or self.needs_input:
            self.forward(self.pre(ws), out, self._tmp(ws), **self.params)
        return out

    def grad(self, ws: dict, dout: np.ndarray) -> np.ndarray:
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
        _entry("linear", _linear_f, _linear_b),
        _entry("relu", _relu_f, _relu_b),
        _entry("relu6", _clip_f, _clip_b, lo=0.0, hi=6.0),
        _entry("leaky_relu", _leaky_f, _leaky_b, scratch=1, negative_slope=0.2),
        _entry("elu", _elu_f, _elu_b, scratch=1, alpha=1.0),
        _entry("selu", _elu_f, _elu_b, scratch=1, alpha=_SELU_ALPHA, scale=_SELU_SCALE),
        _entry("celu", _celu_f, _celu_b, scratch=1, alpha=1.0),
        _entry("sigmoid", _sigmoid_f, _sigmoid_b),
        _entry("hard_sigmoid", _clip_f, _clip_b, lo=0.0, hi=6.0, shift=3.0, scale=1 / 6),
        _entry("hard_tanh", _clip_f, _clip_b, lo=-1.0, hi=1.0),
        _entry("tanh", _tanh_f, _tanh_b),
        _entry("exponential", _exp_f, _exp_b),
        _entry("softplus", _softplus_f, _softplus_b, scratch=1),
        _entry("log_sigmoid", _log_sigmoid_f, _log_sigmoid_b, scratch=1),
        _entry("softsign", _softsign_f, _softsign_b, scratch=1),
        _entry("silu", _silu_f, _silu_b, needs_input=True, scratch=1),
        _entry("hard_silu", _hard_silu_f, _hard_silu_b, needs_input=True, scratch=1),
        _entry("gelu", _gelu_f, _gelu_b, needs_input=True, scratch=2),
        _entry("gelu_tanh", _gelu_tanh_f, _gelu_tanh_b, needs_input=True, scratch=2),
        _entry("mish", _mish_f, _mish_b, needs_input=True, scratch=2),
        _entry("softmax", _softmax_f, _softmax_b),
        _entry("log_softmax", _log_softmax_f, _log_softmax_b, scratch=1),
    )
}
ALIASES = {"swish": "silu", "hard_swish": "hard_silu"}
#: the general ReLU (Keras' ``ReLU`` layer / ``relu(x, ...)`` with non-default arguments)
_RELU_GENERAL = _entry("relu", _relu_general_f, _relu_general_b, needs_input=True, scratch=2)
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

    def forward(self, ws, x):
        if self.act.needs_input:
            ws["z"] = x.reshape(ws["out"].shape)
        else:
            np.copyto(ws["out"], x.reshape(ws["out"].shape))
        return self.act.run(ws)

    def backward_input(self, ws, dout):
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
