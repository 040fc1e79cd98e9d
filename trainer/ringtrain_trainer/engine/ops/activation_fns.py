"""Each activation's forward and backward, side by side: the numbers behind ``activations``' table.

Every pair writes in place into planned buffers (``out``, ``dx``, scratch ``tmp``): ``*_f(x, out,
tmp, ...)`` computes the activation, ``*_b(x, y, dy, dx, tmp, ...)`` its gradient from the input
``x`` and/or the output ``y``. Definitions follow Keras 3 on its TensorFlow backend (see
``activations``' docstring).
"""

from __future__ import annotations

import math

import numpy as np

SELU_ALPHA, SELU_SCALE = 1.6732632423543772, 1.0507009873554805
SQRT_2_PI = math.sqrt(2.0 / math.pi)
#: erfc(z) = t exp(-z² + P(2t - 1)), t = 2 / (2 + z), z ≥ 0: a degree-20 fit (error < 3e-13)
ERFC = (-0.6717940840567023, 0.6726432239781291, 0.04734330684464927, -0.0468956102704072,
         -0.009872689494060801, 0.008824939538553265, 0.0017589357895937815,
         -0.0023458239687429864, -0.00014626614689912013, 0.0006737539207982816,
         -9.364186574094044e-05, -0.0001746051977455762, 7.113649149203178e-05,
         3.2525461785744996e-05, -2.975247380976475e-05, -1.1680637347895809e-06,
         8.202943747924875e-06, -1.5647734674582796e-06, -1.2493501976861678e-06,
         3.914849410209308e-07, 3.9208021590664886e-08)  # fmt: skip
#: the same form for float32: degree 12, error < 6e-9 (float32's rounding is 6e-8; issue 24)
ERFC32 = (-0.6717940851516006, 0.6726431547748186, 0.04734341751090632,
           -0.04689364056635173, -0.009874534782860604, 0.008808825410198028,
           0.001770665468717862, -0.0022887653434233886, -0.00018278074926631317,
           0.0005737664883898164, -3.211513367482771e-05, -8.72838567410807e-05,
           1.3371998496026153e-05)  # fmt: skip


def erf(x: np.ndarray, out: np.ndarray, tmp: np.ndarray, scale: float = 1.0) -> None:
    """``out = erf(scale * x)`` without allocating (numpy has no erf); ``tmp`` is left
    holding ``exp(-(scale * x)²)``, which gelu's gradient reads. float32 uses the degree-12
    fit (``ERFC32``): its error is below float32's rounding, in 39 array passes, not 57."""
    coefs = ERFC if x.dtype == np.float64 else ERFC32
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


def sigmoid(x, out):
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    np.add(out, 1.0, out=out)
    np.multiply(out, 0.5, out=out)


def softplus(x, out, tmp):
    """``out = log(1 + exp(x))``, stable; ``out`` may be ``x``."""
    np.abs(x, out=tmp)
    np.negative(tmp, out=tmp)
    np.exp(tmp, out=tmp)
    np.log1p(tmp, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)


# -- forward (x, out, tmp, **params) and backward (x, y, dy, dx, tmp, **params) -------------
# ``out`` is ``x`` itself unless the entry reads its input; ``dx`` never aliases the others.


def linear_f(x, out, tmp):
    if out is not x:
        np.copyto(out, x)


def linear_b(x, y, dy, dx, tmp):
    np.copyto(dx, dy)


def relu_f(x, out, tmp):
    np.maximum(x, 0, out=out)


def relu_b(x, y, dy, dx, tmp):
    np.greater(y, 0, out=dx)
    np.multiply(dx, dy, out=dx)


def clip_f(x, out, tmp, lo, hi, shift=0.0, scale=1.0):
    """``clip(x + shift, lo, hi) * scale``: relu6, hard_sigmoid, hard_tanh, relu(max_value)."""
    np.add(x, shift, out=out)
    np.clip(out, lo, hi, out=out)
    if scale != 1.0:
        np.multiply(out, scale, out=out)


def clip_b(x, y, dy, dx, tmp, lo, hi, shift=0.0, scale=1.0):
    mid, half = (lo + hi) * 0.5 * scale, (hi - lo) * 0.5 * scale
    np.subtract(y, mid, out=dx)
    np.abs(dx, out=dx)
    np.less(dx, half, out=dx)  # strictly inside the window
    np.multiply(dx, scale, out=dx)
    np.multiply(dx, dy, out=dx)


def relu_general_f(x, out, tmp, negative_slope, max_value, threshold):
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


def relu_general_b(x, y, dy, dx, tmp, negative_slope, max_value, threshold):
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


def leaky_f(x, out, tmp, negative_slope):
    np.multiply(x, negative_slope, out=tmp)
    (np.maximum if negative_slope <= 1 else np.minimum)(x, tmp, out=out)


def leaky_b(x, y, dy, dx, tmp, negative_slope):
    np.greater(y, 0, out=dx)
    np.multiply(dx, 1.0 - negative_slope, out=dx)
    np.add(dx, negative_slope, out=dx)
    np.multiply(dx, dy, out=dx)


def elu_f(x, out, tmp, alpha, scale=1.0):
    """``scale * (x if x > 0 else alpha * (exp(x) - 1))``: elu, and selu with its constants."""
    np.minimum(x, 0, out=tmp)
    np.expm1(tmp, out=tmp)
    np.multiply(tmp, alpha, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)
    if scale != 1.0:
        np.multiply(out, scale, out=out)


def elu_b(x, y, dy, dx, tmp, alpha, scale=1.0):
    # scale above 0, y + scale alpha below: [y > 0] (scale - scale alpha) + min(y, 0) + scale alpha
    np.greater(y, 0, out=dx)
    np.multiply(dx, scale - scale * alpha, out=dx)
    np.minimum(y, 0, out=tmp)
    np.add(dx, tmp, out=dx)
    np.add(dx, scale * alpha, out=dx)
    np.multiply(dx, dy, out=dx)


def celu_f(x, out, tmp, alpha):
    np.minimum(x, 0, out=tmp)
    np.multiply(tmp, 1.0 / alpha, out=tmp)
    np.expm1(tmp, out=tmp)
    np.multiply(tmp, alpha, out=tmp)
    np.maximum(x, 0, out=out)
    np.add(out, tmp, out=out)


def celu_b(x, y, dy, dx, tmp, alpha):
    np.minimum(y, 0, out=dx)  # exp(x / alpha) = y / alpha + 1 below zero, 1 above
    np.multiply(dx, 1.0 / alpha, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, dy, out=dx)


def sigmoid_f(x, out, tmp):
    sigmoid(x, out)


def sigmoid_b(x, y, dy, dx, tmp):
    np.subtract(1.0, y, out=dx)
    np.multiply(dx, y, out=dx)
    np.multiply(dx, dy, out=dx)


def tanh_f(x, out, tmp):
    np.tanh(x, out=out)


def tanh_b(x, y, dy, dx, tmp):
    np.multiply(y, y, out=dx)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def exp_f(x, out, tmp):
    np.exp(x, out=out)


def exp_b(x, y, dy, dx, tmp):
    np.multiply(y, dy, out=dx)


def softplus_f(x, out, tmp):
    softplus(x, out, tmp)


def softplus_b(x, y, dy, dx, tmp):
    np.negative(y, out=dx)  # sigmoid(x) = 1 - exp(-y)
    np.exp(dx, out=dx)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def log_sigmoid_f(x, out, tmp):
    np.negative(x, out=out)
    softplus(out, out, tmp)
    np.negative(out, out=out)


def log_sigmoid_b(x, y, dy, dx, tmp):
    np.exp(y, out=dx)  # sigmoid(-x) = 1 - exp(y)
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def softsign_f(x, out, tmp):
    np.abs(x, out=tmp)
    np.add(tmp, 1.0, out=tmp)
    np.divide(x, tmp, out=out)


def softsign_b(x, y, dy, dx, tmp):
    np.abs(y, out=dx)  # 1 / (1 + |x|) = 1 - |y|
    np.subtract(1.0, dx, out=dx)
    np.multiply(dx, dx, out=dx)
    np.multiply(dx, dy, out=dx)


def silu_f(x, out, tmp):
    sigmoid(x, tmp)
    np.multiply(x, tmp, out=out)


def silu_b(x, y, dy, dx, tmp):
    sigmoid(x, tmp)  # s (1 + x (1 - s))
    np.subtract(1.0, tmp, out=dx)
    np.multiply(dx, x, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def hard_silu_f(x, out, tmp):
    np.add(x, 3.0, out=out)
    np.clip(out, 0.0, 6.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 1.0 / 6.0, out=out)


def hard_silu_b(x, y, dy, dx, tmp):
    np.multiply(x, 1.0 / 3.0, out=dx)  # (2x + 3) / 6 inside (-3, 3), 1 above, 0 below
    np.add(dx, 0.5, out=dx)
    np.abs(x, out=tmp)
    np.less(tmp, 3.0, out=tmp)
    np.multiply(dx, tmp, out=dx)
    np.greater_equal(x, 3.0, out=tmp)
    np.add(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def gelu_f(x, out, tmp):
    """Keeps ``erf(x/√2)`` and ``exp(-x²/2)`` in the scratch for :func:`gelu_b`."""
    erf(x, tmp[0], tmp[1], 1.0 / math.sqrt(2.0))
    np.add(tmp[0], 1.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 0.5, out=out)


def gelu_b(x, y, dy, dx, tmp):
    """``Φ(x) + x φ(x)`` from what :func:`gelu_f` left in the scratch (no second erf)."""
    np.add(tmp[0], 1.0, out=dx)
    np.multiply(dx, 0.5, out=dx)
    tmp = tmp[1]
    np.multiply(tmp, x, out=tmp)
    np.multiply(tmp, 1.0 / math.sqrt(2.0 * math.pi), out=tmp)
    np.add(dx, tmp, out=dx)
    np.multiply(dx, dy, out=dx)


def gelu_tanh_inner(x, t):
    """``t = tanh(sqrt(2/pi) (x + 0.044715 x³))``."""
    np.multiply(x, x, out=t)
    np.multiply(t, 0.044715, out=t)
    np.add(t, 1.0, out=t)
    np.multiply(t, x, out=t)
    np.multiply(t, SQRT_2_PI, out=t)
    np.tanh(t, out=t)


def gelu_tanh_f(x, out, tmp):
    gelu_tanh_inner(x, tmp[0])
    np.add(tmp[0], 1.0, out=out)
    np.multiply(out, x, out=out)
    np.multiply(out, 0.5, out=out)


def gelu_tanh_b(x, y, dy, dx, tmp):
    th, t1 = tmp  # 0.5 (1 + th) + 0.5 x (1 - th²) k (1 + 3 c x²)
    gelu_tanh_inner(x, th)
    np.multiply(x, x, out=dx)
    np.multiply(dx, 3 * 0.044715, out=dx)
    np.add(dx, 1.0, out=dx)
    np.multiply(dx, x, out=dx)
    np.multiply(dx, 0.5 * SQRT_2_PI, out=dx)
    np.multiply(th, th, out=t1)
    np.subtract(1.0, t1, out=t1)
    np.multiply(dx, t1, out=dx)
    np.add(th, 1.0, out=t1)
    np.multiply(t1, 0.5, out=t1)
    np.add(dx, t1, out=dx)
    np.multiply(dx, dy, out=dx)


def mish_f(x, out, tmp):
    t = tmp[0]
    softplus(x, t, out)
    np.tanh(t, out=t)
    np.multiply(x, t, out=out)


def mish_b(x, y, dy, dx, tmp):
    th, t1 = tmp  # th + x (1 - th²) sigmoid(x), th = tanh(softplus(x))
    softplus(x, th, t1)
    np.tanh(th, out=th)
    sigmoid(x, dx)
    np.multiply(dx, x, out=dx)
    np.multiply(th, th, out=t1)
    np.subtract(1.0, t1, out=t1)
    np.multiply(dx, t1, out=dx)
    np.add(dx, th, out=dx)
    np.multiply(dx, dy, out=dx)


def rows(a):
    return a.reshape(-1, a.shape[-1])


def softmax_f(x, out, tmp):
    z = rows(out)
    np.subtract(rows(x), rows(x).max(axis=1, keepdims=True), out=z)
    np.exp(z, out=z)
    np.divide(z, z.sum(axis=1, keepdims=True), out=z)


def softmax_b(x, y, dy, dx, tmp):
    y2, dy2 = rows(y), rows(dy)
    s = np.einsum("ij,ij->i", y2, dy2)[:, None]
    np.subtract(dy2, s, out=rows(dx))
    np.multiply(dx, y, out=dx)


def log_softmax_f(x, out, tmp):
    z, e = rows(out), rows(tmp)
    np.subtract(rows(x), rows(x).max(axis=1, keepdims=True), out=z)
    np.exp(z, out=e)
    lse = e.sum(axis=1, keepdims=True)
    np.log(lse, out=lse)
    np.subtract(z, lse, out=z)


def log_softmax_b(x, y, dy, dx, tmp):
    np.exp(y, out=dx)  # dy - softmax(x) * sum(dy)
    np.multiply(rows(dx), rows(dy).sum(axis=1, keepdims=True), out=rows(dx))
    np.subtract(dy, dx, out=dx)
