"""Conv1D/Conv2D, DepthwiseConv1D/2D and SeparableConv1D/2D (``engine.ops.conv`` and
``engine.ops.depthwise``): every geometry against finite differences (input and weights, whole
and in row blocks), the forward against the real Keras layer with the same weights, and a
training step that allocates nothing in proportion to the tensors."""

import tracemalloc

import keras
import numpy as np
import pytest
from support.opcheck import check_gradients, compile_op, forward, random_params

from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.depthwise import Depthwise, Separable
from ringtrain_trainer.engine.ops.window import pad_1d

#: (padding, strides, dilation) combinations Keras accepts (strides and dilation not both > 1)
GEOMETRY = [
    ("valid", 1, 1),
    ("same", 1, 1),
    ("valid", 2, 1),
    ("same", 2, 1),
    ("same", 3, 1),
    ("valid", 1, 2),
    ("same", 1, 2),
]
GEOMETRY_1D = [*GEOMETRY, ("causal", 1, 1), ("causal", 2, 1), ("causal", 1, 3)]


def keras_forward(layer, in_shape, weights, x) -> np.ndarray:
    layer.build((None, *in_shape))
    layer.set_weights([w.astype(np.float32) for w in weights])
    return np.asarray(layer(x.astype(np.float32)))


def match_keras(op, layer, rng, b=2):
    x = rng.normal(size=(b, *op.in_shape))
    params = random_params(op, rng)
    ours = forward(op, x, params)
    theirs = keras_forward(layer, op.in_shape, list(params.values()), x)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_padding_arithmetic_matches_tensorflow():
    assert pad_1d(7, 3, 2, 1, "same") == (4, 1, 1)
    assert pad_1d(6, 3, 2, 1, "same") == (3, 0, 1)  # the odd pixel goes after
    assert pad_1d(9, 3, 1, 2, "same") == (9, 2, 2)
    assert pad_1d(9, 3, 1, 2, "valid") == (5, 0, 0)
    assert pad_1d(9, 3, 2, 2, "causal") == (5, 4, 0)
    with pytest.raises(ValueError, match="padding='full'"):
        pad_1d(9, 3, 1, 1, "full")


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY_1D)
def test_conv1d(padding, strides, dilation, rng):
    op = Conv((9, 3), 4, 3, strides, padding, dilation, "tanh")
    check_gradients(op, rng)
    layer = keras.layers.Conv1D(4, 3, strides, padding, dilation_rate=dilation, activation="tanh")
    match_keras(op, layer, rng)


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY)
def test_conv2d(padding, strides, dilation, rng):
    op = Conv((7, 6, 2), 3, (3, 2), strides, padding, dilation, "relu", use_bias=False)
    check_gradients(op, rng)
    layer = keras.layers.Conv2D(
        3, (3, 2), strides, padding, dilation_rate=dilation, activation="relu", use_bias=False
    )
    match_keras(op, layer, rng)


@pytest.mark.parametrize("strides,padding", [((1, 1), "valid"), ((2, 1), "same")])
def test_conv2d_one_by_one(strides, padding, rng):
    op = Conv((4, 5, 3), 6, 1, strides, padding, 1, "gelu")
    assert op.pointwise == (strides == (1, 1))
    check_gradients(op, rng)
    match_keras(op, keras.layers.Conv2D(6, 1, strides, padding, activation="gelu"), rng)


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY)
@pytest.mark.parametrize("multiplier", [1, 2])
def test_depthwise_conv2d(padding, strides, dilation, multiplier, rng):
    op = Depthwise((7, 6, 3), (3, 2), strides, padding, dilation, multiplier, "relu6")
    check_gradients(op, rng)
    layer = keras.layers.DepthwiseConv2D(
        (3, 2), strides, padding, multiplier, dilation_rate=dilation, activation="relu6"
    )
    match_keras(op, layer, rng)


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY[::2])
def test_depthwise_conv1d(padding, strides, dilation, rng):
    op = Depthwise((9, 2), 3, strides, padding, dilation, 2, "linear", use_bias=False)
    check_gradients(op, rng)
    layer = keras.layers.DepthwiseConv1D(
        3, strides, padding, 2, dilation_rate=dilation, use_bias=False
    )
    match_keras(op, layer, rng)


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY[::2])
def test_separable_conv2d(padding, strides, dilation, rng):
    op = Separable((7, 6, 3), 4, 3, strides, padding, dilation, 2, "swish")
    assert [p.name for p in op.params(0)] == ["depthwise_kernel", "pointwise_kernel", "bias"]
    check_gradients(op, rng)
    layer = keras.layers.SeparableConv2D(
        4, 3, strides, padding, dilation_rate=dilation, depth_multiplier=2, activation="swish"
    )
    match_keras(op, layer, rng)


def test_separable_conv1d(rng):
    op = Separable((9, 3), 5, 3, 1, "same", 2, 1, "elu", use_bias=False)
    check_gradients(op, rng)
    layer = keras.layers.SeparableConv1D(
        5, 3, padding="same", dilation_rate=2, activation="elu", use_bias=False
    )
    match_keras(op, layer, rng)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="causal"):
        Conv((5, 5, 2), 3, 3, padding="causal")
    with pytest.raises(ValueError, match="smaller than"):
        Conv((4, 2), 3, 3, dilation=3)
    with pytest.raises(ValueError, match="strides"):
        Conv((5, 5, 2), 3, 3, strides=(1, 0))
    with pytest.raises(ValueError, match="activation 'swishy'"):
        Conv((5, 2), 3, 3, activation="swishy")


@pytest.mark.parametrize(
    "op",
    [
        Conv((32, 32, 8), 16, 3, 1, "same", 1, "gelu"),
        Conv((1024, 16), 32, 5, 1, "causal", 2, "relu"),
        Depthwise((32, 32, 8), 3, 1, "same", 1, 2, "relu6"),
        Separable((32, 32, 8), 16, 3, 1, "same", 1, 1, "swish"),
        Conv((8, 16, 16, 8), 16, 3, 1, "same", 1, "gelu"),
    ],
    ids=["conv2d", "conv1d", "depthwise", "separable", "conv3d"],
)
def test_a_training_step_allocates_nothing_proportional(op, rng):
    """After the first step, forward + backward allocate at most numpy's fixed iteration
    buffers (~100 KB, whatever the size), far below one activation (≥ 512 KiB here)."""
    b = 8
    ws = compile_op(op, b, dtype=np.float32)
    x = rng.normal(size=(b, *op.in_shape)).astype(np.float32)
    params = {k: v.astype(np.float32) for k, v in random_params(op, rng).items()}
    grads = {p.name: np.zeros(p.shape, np.float32) for p in op.params(0)}

    def step():
        out = op.forward(ws, x, **params)
        op.backward_local(ws, out)
        op.backward_input(ws, out, **params)
        for p in op.params(0):
            op.backward_weights(ws, out, p.name, grads[p.name], (0, p.rows))

    step()
    tracemalloc.start()
    try:
        step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ws["out"].nbytes >= 2**19
    assert peak < 2**17, peak


def _float32_step(op, x, params, dout, gemm: bool, monkeypatch):
    """One float32 forward and backward of ``op``, on the compiled GEMM or on numpy/BLAS."""
    from ringtrain_trainer.engine import native

    with monkeypatch.context() as m:  # on this CPU's set, whether or not it is the default
        m.setattr(native, "CONV_GEMM_SETS", (native.kernels.isa(),) if gemm else ())
        ws = compile_op(op, x.shape[0], dtype=np.float32)
    assert ws["gemm"] is gemm
    p = {k: v.astype(np.float32) for k, v in params.items()}
    out = np.array(op.forward(ws, x.astype(np.float32), **p))
    op.backward_local(ws, dout)
    grads = {}
    for s in op.params(0):
        g = np.zeros(s.shape, np.float32)
        op.backward_weights(ws, dout, s.name, g, (0, op.kk if s.name == "kernel" else 1))
        grads[s.name] = g
    return out, np.array(op.backward_input(ws, dout, **p)), grads


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY)
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_the_compiled_gemm_conv_matches_numpys(
    padding, strides, dilation, rank, rng, monkeypatch, kernel_set
):
    """On each kernel set: the GEMM reads the (padded) input in place through offset tables and
    computes the input gradient as a convolution of the output gradient; every geometry and
    rank against the im2col + BLAS path in float32 (one rounding apart)."""
    shape = {1: (9, 3), 2: (7, 6, 2), 3: (5, 6, 5, 2)}[rank]
    op = Conv(shape, 5, (3,) * rank if rank != 2 else (3, 2), strides, padding, dilation, "relu")
    x = rng.normal(size=(3, *shape))
    params = random_params(op, rng)
    dout = rng.normal(size=(3, *op.out_shape)).astype(np.float32)
    fast = _float32_step(op, x, params, dout, True, monkeypatch)
    slow = _float32_step(op, x, params, dout, False, monkeypatch)
    np.testing.assert_allclose(fast[0], slow[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast[1], slow[1], rtol=1e-5, atol=1e-5)
    for name in fast[2]:
        np.testing.assert_allclose(fast[2][name], slow[2][name], rtol=1e-5, atol=1e-5)


def _depthwise_f32(op, x, kernel, dout, use_native: bool, monkeypatch):
    from ringtrain_trainer.engine import native

    with monkeypatch.context() as m:
        if not use_native:
            m.setattr(native, "kernels", None)
        ws = compile_op(op, x.shape[0], dtype=np.float32)
    assert ws["native"] is use_native
    out = np.array(op.forward(ws, x, kernel))
    op.backward_local(ws, dout)
    g = np.zeros(kernel.shape, np.float32)
    op.backward_weights(ws, dout, "kernel", g, (0, g.size // op.m))
    return out, g, np.array(op.backward_input(ws, dout, kernel))


@pytest.mark.parametrize("padding,strides,dilation", GEOMETRY)
@pytest.mark.parametrize("channels,multiplier", [(8, 1), (3, 2)])
def test_the_compiled_depthwise_matches_numpys(
    padding, strides, dilation, channels, multiplier, rng, monkeypatch, kernel_set
):
    """On each kernel set: the compiled depthwise kernels (every output summed over its taps in
    registers, the input gradient gathered per position) against the numpy passes in float32,
    every geometry, the vectorised (8 channels) and the general (multiplier 2) loops."""
    op = Depthwise((9, 8, channels), 3, strides, padding, dilation, multiplier, use_bias=False)
    x = rng.normal(size=(3, *op.in_shape)).astype(np.float32)
    kernel = rng.normal(size=(3, 3, channels, multiplier)).astype(np.float32)
    dout = rng.normal(size=(3, *op.out_shape)).astype(np.float32)
    fast = _depthwise_f32(op, x, kernel, dout, True, monkeypatch)
    slow = _depthwise_f32(op, x, kernel, dout, False, monkeypatch)
    for f, s, what in zip(fast, slow, ("output", "kernel gradient", "input gradient"), strict=True):
        np.testing.assert_allclose(f, s, rtol=1e-5, atol=1e-5, err_msg=what)
