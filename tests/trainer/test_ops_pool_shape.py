"""Pooling (``engine.ops.pool``) and the value-moving ops (``engine.ops.shape``), 1-D and 2-D:
finite differences for the input gradient, the forward against the real Keras layer."""

import keras
import numpy as np
import pytest
from support.opcheck import check_gradients, compile_op, forward

from ringtrain_trainer.engine.ops.pool import GlobalPool, Pool
from ringtrain_trainer.engine.ops.shape import Border, UpSampling

KERAS_POOL = {
    ("max", 1): keras.layers.MaxPooling1D,
    ("avg", 1): keras.layers.AveragePooling1D,
    ("max", 2): keras.layers.MaxPooling2D,
    ("avg", 2): keras.layers.AveragePooling2D,
}
KERAS_GLOBAL = {
    ("max", 1): keras.layers.GlobalMaxPooling1D,
    ("avg", 1): keras.layers.GlobalAveragePooling1D,
    ("max", 2): keras.layers.GlobalMaxPooling2D,
    ("avg", 2): keras.layers.GlobalAveragePooling2D,
}


def match_keras(op, layer, rng, b=2):
    x = rng.normal(size=(b, *op.in_shape))
    ours = forward(op, x, {})
    theirs = np.asarray(layer(x.astype(np.float32)))
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize(
    "pool,strides,padding",
    [(2, None, "valid"), (3, None, "same"), (3, 2, "valid"), (3, 2, "same"), (2, 1, "same")],
)
def test_pooling_1d(kind, pool, strides, padding, rng):
    op = Pool((9, 3), kind, pool, strides, padding)
    check_gradients(op, rng)
    match_keras(op, KERAS_POOL[kind, 1](pool, strides, padding), rng)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize(
    "pool,strides,padding",
    [((2, 2), None, "valid"), ((3, 2), (2, 1), "same"), ((3, 3), (2, 2), "same")],
)
def test_pooling_2d(kind, pool, strides, padding, rng):
    op = Pool((7, 6, 2), kind, pool, strides, padding)
    check_gradients(op, rng)
    match_keras(op, KERAS_POOL[kind, 2](pool, strides, padding), rng)


def test_max_pooling_gives_a_tie_to_the_first_maximum():
    """TF's MaxPoolGrad: overlapping windows sharing one maximum each send it their gradient."""
    op = Pool((4, 1), "max", 2, 1, "valid")
    x = np.array([[[1.0], [3.0], [3.0], [0.0]]])
    ws = compile_op(op, 1)
    np.testing.assert_array_equal(op.forward(ws, x)[0, :, 0], [3, 3, 3])
    dx = op.backward_input(ws, np.ones((1, 3, 1)))
    np.testing.assert_array_equal(dx[0, :, 0], [0, 2, 1, 0])


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("in_shape", [(7, 3), (4, 5, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("fmt", ["channels_last", "channels_first"])
def test_global_pooling(kind, in_shape, keepdims, fmt, rng):
    op = GlobalPool(in_shape, kind, keepdims, channels_first=fmt == "channels_first")
    check_gradients(op, rng)
    match_keras(op, KERAS_GLOBAL[kind, len(in_shape) - 1](keepdims=keepdims, data_format=fmt), rng)


def test_global_max_splits_a_tie_evenly():
    op = GlobalPool((3, 1), "max")
    ws = compile_op(op, 1)
    op.forward(ws, np.array([[[2.0], [2.0], [1.0]]]))
    np.testing.assert_array_equal(op.backward_input(ws, np.ones((1, 1)))[0, :, 0], [0.5, 0.5, 0])


@pytest.mark.parametrize(
    "in_shape,sides,mode,layer",
    [
        ((5, 3), 2, "pad", keras.layers.ZeroPadding1D(2)),
        ((5, 3), (1, 3), "pad", keras.layers.ZeroPadding1D((1, 3))),
        ((4, 5, 2), (1, 2), "pad", keras.layers.ZeroPadding2D((1, 2))),
        ((4, 5, 2), ((0, 1), (2, 3)), "pad", keras.layers.ZeroPadding2D(((0, 1), (2, 3)))),
        ((7, 3), (1, 2), "crop", keras.layers.Cropping1D((1, 2))),
        ((6, 7, 2), 1, "crop", keras.layers.Cropping2D(1)),
        ((6, 7, 2), ((2, 0), (1, 3)), "crop", keras.layers.Cropping2D(((2, 0), (1, 3)))),
    ],
)
def test_zero_padding_and_cropping(in_shape, sides, mode, layer, rng):
    op = Border(in_shape, sides, mode)
    check_gradients(op, rng)
    match_keras(op, layer, rng)


@pytest.mark.parametrize(
    "in_shape,size,layer",
    [
        ((4, 3), 3, keras.layers.UpSampling1D(3)),
        ((3, 4, 2), 2, keras.layers.UpSampling2D(2)),
        ((3, 4, 2), (1, 3), keras.layers.UpSampling2D((1, 3))),
    ],
)
def test_upsampling(in_shape, size, layer, rng):
    op = UpSampling(in_shape, size)
    check_gradients(op, rng)
    match_keras(op, layer, rng)


def test_refusals():
    with pytest.raises(ValueError, match="causal"):
        Pool((5, 2), "max", 2, padding="causal")
    with pytest.raises(ValueError, match="leaves nothing"):
        Border((4, 2), (2, 2), "crop")
    with pytest.raises(ValueError, match="pairs"):
        Border((4, 4, 2), ((1, 2, 3),), "pad")
    with pytest.raises(ValueError, match="kind"):
        GlobalPool((4, 2), "sum")
