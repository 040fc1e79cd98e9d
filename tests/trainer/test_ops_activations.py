"""The activation table (``engine.ops.activations``): every entry's forward and gradient
against Keras' own function and TensorFlow's gradient in float64, the gradient against finite
differences, and the registry's refusals."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.gradcheck import gradcheck
from support.opcheck import check_gradients

from ringtrain_trainer.engine.ops import activation_fns as F
from ringtrain_trainer.engine.ops import activations as A

#: entry → (how to get ours, Keras' function)
CASES = {
    **{n: ((n, {}), keras.activations.get(n)) for n in A.ACTIVATIONS if n != "gelu_tanh"},
    **{a: ((a, {}), keras.activations.get(a)) for a in A.ALIASES},
    "gelu_tanh": (("gelu", {"approximate": True}),
                  lambda x: keras.activations.gelu(x, approximate=True)),
    "leaky_relu-0.05": (("leaky_relu", {"negative_slope": 0.05}),
                        lambda x: keras.activations.leaky_relu(x, negative_slope=0.05)),
    "elu-0.7": (("elu", {"alpha": 0.7}), lambda x: keras.activations.elu(x, alpha=0.7)),
    "celu-1.5": (("celu", {"alpha": 1.5}), lambda x: keras.activations.celu(x, alpha=1.5)),
    "relu-max": (("relu", {"max_value": 3.0}),
                 lambda x: keras.activations.relu(x, max_value=3.0)),
    "relu-general": (("relu", {"negative_slope": 0.1, "max_value": 4.0, "threshold": 0.5}),
                     lambda x: keras.activations.relu(x, negative_slope=0.1, max_value=4.0,
                                                      threshold=0.5)),
}  # fmt: skip

SHAPE = (3, 4, 5)


def run(act, x, dy):
    """Forward and backward through the op-facing API, as a Dense or Conv runs them."""
    ws = {k: np.zeros(s) for k, (s, _) in act.buffers(x.shape, True).items()}
    ws["out"] = np.zeros(x.shape)
    np.copyto(act.pre(ws), x)
    y = act.run(ws).copy()
    return y, np.array(act.grad(ws, dy))


@pytest.mark.parametrize("case", list(CASES))
def test_activation_matches_keras_and_tensorflow(case, rng):
    (name, params), theirs = CASES[case]
    act = A.get(name, **params)
    x = rng.normal(size=SHAPE) * 3
    dy = rng.normal(size=SHAPE)
    y, dx = run(act, x, dy)
    tx = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(tx)
        ty = theirs(tx)
        loss = tf.reduce_sum(ty * dy)
    # TensorFlow rounds some constants to float32 (leaky_relu's slope, gelu's sqrt(2)): 2e-7
    np.testing.assert_allclose(y, ty.numpy(), atol=1e-9, rtol=2e-7)
    np.testing.assert_allclose(dx, tape.gradient(loss, tx).numpy(), atol=1e-8, rtol=2e-7)

    def f():
        return float(np.sum(run(act, x, dy)[0] * dy))

    gradcheck(f, x, dx, rng=rng, samples=20, what=case)


def test_erf_is_accurate_everywhere():
    import math

    x = np.linspace(-8, 8, 4001)
    out, tmp = np.empty_like(x), np.empty_like(x)
    F.erf(x, out, tmp)
    np.testing.assert_allclose(out, [math.erf(v) for v in x], atol=1e-12, rtol=0)


def test_sigmoid_and_softplus_do_not_overflow(rng):
    x = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        for name in ("sigmoid", "softplus", "silu", "mish", "log_sigmoid", "gelu", "elu"):
            y, dx = run(A.get(name), x, np.ones_like(x))
            assert np.isfinite(y).all() and np.isfinite(dx).all(), name


def test_unknown_names_and_arguments_are_refused():
    with pytest.raises(ValueError, match="activation 'sparsemax' is not supported"):
        A.get("sparsemax")
    with pytest.raises(ValueError, match="no argument"):
        A.get("elu", slope=2)
    with pytest.raises(ValueError, match="threshold < 0"):
        A.get("relu", threshold=-1.0)
    assert A.get("swish") is A.ACTIVATIONS["silu"]
    assert A.get("relu", negative_slope=0.0) is A.ACTIVATIONS["relu"]


@pytest.mark.parametrize("name", ["gelu", "relu6", "softmax", "linear", "elu", "mish"])
def test_the_activation_op_passes_the_gradient_check(name, rng):
    check_gradients(A.Act((3, 4), name), rng)
    check_gradients(A.Act((5,), A.get("relu", max_value=2.0, negative_slope=0.2)), rng)
