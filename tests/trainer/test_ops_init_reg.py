"""Initializers and regularizers (``engine.ops.initializers`` / ``regularizers``) against Keras:
each initializer's distribution (its moments and bounds) beside Keras' own draw of the same
shape, parsed from the config Keras serialises; each regularizer's loss term and gradient
beside Keras' value and TensorFlow's gradient."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from ringtrain_trainer.engine.ops import initializers as I
from ringtrain_trainer.engine.ops import regularizers as R

SHAPE = (3, 3, 32, 64)

KERAS_INITS = [
    keras.initializers.GlorotUniform(),
    keras.initializers.GlorotNormal(),
    keras.initializers.HeNormal(),
    keras.initializers.HeUniform(),
    keras.initializers.LecunNormal(),
    keras.initializers.LecunUniform(),
    keras.initializers.RandomNormal(0.1, 0.2),
    keras.initializers.RandomUniform(-0.3, 0.1),
    keras.initializers.TruncatedNormal(0.0, 0.3),
    keras.initializers.VarianceScaling(0.5, "fan_out", "uniform"),
    keras.initializers.VarianceScaling(3.0, "fan_avg", "untruncated_normal"),
    keras.initializers.VarianceScaling(2.0, "fan_in", "truncated_normal"),
    keras.initializers.Zeros(),
    keras.initializers.Ones(),
    keras.initializers.Constant(0.25),
]


@pytest.mark.parametrize("init", KERAS_INITS, ids=lambda i: type(i).__name__)
def test_initializer_distribution_matches_keras(init):
    ours = I.parse(keras.initializers.serialize(init), "kernel_initializer")
    a = ours(SHAPE, np.random.default_rng(0), np.float64)
    k = np.asarray(init(SHAPE), np.float64)
    assert a.shape == k.shape
    spread = max(k.std(), 1e-3)
    assert abs(a.mean() - k.mean()) < 0.03 * spread + 1e-12
    np.testing.assert_allclose(a.std(), k.std(), rtol=0.03, atol=1e-12)
    if "untruncated" not in str(init.get_config()) and type(init).__name__ != "RandomNormal":
        # bounded: uniform limits, truncation at two standard deviations
        np.testing.assert_allclose(
            [a.min(), a.max()], [k.min(), k.max()], atol=0.05 * spread + 1e-12
        )


def test_snake_case_names_and_orthogonal():
    assert I.parse("he_normal") == I.Initializer("HeNormal")
    assert I.parse("glorot_uniform") == I.Initializer("GlorotUniform")
    q = I.parse({"class_name": "Orthogonal", "config": {"gain": 2.0, "seed": 3}})(
        (3, 3, 4, 8), np.random.default_rng(1), np.float64
    )
    flat = q.reshape(-1, 8)
    np.testing.assert_allclose(flat.T @ flat, 4.0 * np.eye(8), atol=1e-12)


def test_initializer_refusals_name_the_argument():
    with pytest.raises(ValueError, match="kernel_initializer='magic'"):
        I.parse("magic", "kernel_initializer")
    with pytest.raises(ValueError, match=r"config.scale=3.*HeNormal"):
        I.parse({"class_name": "HeNormal", "config": {"scale": 3}}, "kernel_initializer")
    with pytest.raises(ValueError, match=r"config\.mode"):
        I.parse({"class_name": "VarianceScaling", "config": {"mode": "fan_sum"}})


@pytest.mark.parametrize(
    "reg",
    [keras.regularizers.L1(0.03), keras.regularizers.L2(0.02), keras.regularizers.L1L2(0.01, 0.04)],
    ids=["l1", "l2", "l1l2"],
)
def test_regularizer_matches_keras(reg, rng):
    ours = R.parse(keras.regularizers.serialize(reg))
    w = rng.normal(size=(5, 7))
    tw = tf.Variable(w)
    with tf.GradientTape() as tape:
        value = reg(tw)
    grad, scratch = np.ones_like(w), np.empty_like(w)
    ours.add_grad(w, grad, scratch)
    # Keras keeps l1/l2 as float32 constants: 1e-7
    np.testing.assert_allclose(ours.loss(w), float(value), rtol=1e-7)
    np.testing.assert_allclose(grad - 1, tape.gradient(value, tw).numpy(), rtol=1e-7, atol=1e-12)


def test_regularizer_names_and_refusals():
    assert R.parse(None) is None
    assert R.parse("l2") == R.Regularizer(0.0, 0.01)
    assert R.parse("l1") == R.Regularizer(0.01, 0.0)
    with pytest.raises(ValueError, match=r"kernel_regularizer=.*OrthogonalRegularizer"):
        R.parse({"class_name": "OrthogonalRegularizer", "config": {"factor": 0.01}})
    with pytest.raises(ValueError, match=r"config\.l3"):
        R.parse({"class_name": "L1L2", "config": {"l3": 1}})
