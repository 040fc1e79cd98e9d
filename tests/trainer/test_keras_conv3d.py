"""Keras ``Conv3D``, ``Max/AveragePooling3D``, ``GlobalMax/GlobalAveragePooling3D`` and
``ZeroPadding3D``/``Cropping3D``/``UpSampling3D`` (the video / CT-scan models of keras.io): the
ops (``engine.ops.conv``/``pool``/``shape`` on the N-d ``Window``) against finite differences
and the real Keras layers for each geometry, small 3-D models trained by ringtrain and by Keras
from the same ``.keras`` weights on the same batches, their export reloaded by Keras and run by
onnxruntime, and what stays refused named."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest
from support.opcheck import check_gradients, forward, random_params

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import exports_predict, follows_keras, train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.pool import GlobalPool, Pool
from ringtrain_trainer.engine.ops.shape import Border, UpSampling
from ringtrain_trainer.export import write_onnx
from ringtrain_trainer.keras import load as keras_model

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
IN = (4, 5, 4, 2)


def _match(op, layer, rng, params=None) -> None:
    x = rng.normal(size=(2, *op.in_shape))
    params = {} if params is None else params
    ours = forward(op, x, params)
    layer.build((None, *op.in_shape))
    if params:
        layer.set_weights([v.astype(np.float32) for v in params.values()])
    theirs = np.asarray(layer(x.astype(np.float32)))
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "padding,strides,dilation",
    [("valid", 1, 1), ("same", 1, 1), ("same", 2, 1), ("valid", (1, 2, 1), 1), ("same", 1, 2)],
)
def test_conv3d_gradients_and_forward(padding, strides, dilation, rng):
    op = Conv(IN, 3, (2, 3, 2), strides, padding, dilation, "tanh")
    check_gradients(op, rng)
    layer = L.Conv3D(3, (2, 3, 2), strides, padding, dilation_rate=dilation, activation="tanh")
    _match(op, layer, rng, random_params(op, rng))


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("padding,strides", [("valid", None), ("same", None), ("same", 1)])
def test_pool3d_gradients_and_forward(kind, padding, strides, rng):
    op = Pool(IN, kind, 2, strides, padding)
    # distinct values: a max pool's gradient is not differentiable at ties
    x = rng.permutation(np.arange(2 * np.prod(IN), dtype=float)).reshape(2, *IN) / 50
    check_gradients(op, rng, x=x)
    cls = L.MaxPooling3D if kind == "max" else L.AveragePooling3D
    _match(op, cls(2, strides, padding), rng)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_global_pool3d_gradients_and_forward(kind, rng):
    op = GlobalPool(IN, kind)
    check_gradients(op, rng)
    cls = L.GlobalMaxPooling3D if kind == "max" else L.GlobalAveragePooling3D
    _match(op, cls(), rng)


@pytest.mark.parametrize(
    "op",
    [
        Border(IN, ((1, 0), (0, 2), (1, 1)), "pad"),
        Border(IN, ((1, 0), (1, 2), (0, 1)), "crop"),
        UpSampling(IN, (2, 1, 3)),
    ],
    ids=["zeropadding3d", "cropping3d", "upsampling3d"],
)
def test_shape3d_gradients(op, rng):
    check_gradients(op, rng)


def _shapes() -> keras.Model:
    return keras.Sequential(
        [
            L.Input((4, 4, 4, 2)),
            L.ZeroPadding3D((1, 0, 1)),
            L.Conv3D(3, 2, activation="relu"),
            L.Cropping3D(((0, 1), (1, 0), (0, 0))),
            L.UpSampling3D((1, 2, 1)),
            L.GlobalMaxPooling3D(),
            L.Dense(3, activation="softmax"),
        ]
    )


def _cnn() -> keras.Model:
    return keras.Sequential(
        [
            L.Input((8, 8, 8, 1)),
            L.Conv3D(4, 3, padding="same", activation="relu"),
            L.MaxPooling3D(2),
            L.Conv3D(4, 3, strides=(1, 2, 1), activation="relu"),
            L.AveragePooling3D(2, padding="same"),
            L.GlobalAveragePooling3D(),
            L.Dense(3, activation="softmax"),
        ]
    )


@pytest.mark.parametrize("make", [_cnn, _shapes], ids=["cnn", "shape_layers"])
def test_conv3d_models_train_like_keras_and_export(make, tmp_path, rng):
    km = make()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(40, *km.input_shape[1:])).astype(np.float32)
    y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 4, 8, n_train=32)
    try:
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    follows_keras(ours, theirs, weights, km, rtol=1e-4, atol=1e-5)
    want = km.predict(x[32:], verbose=0)
    exports_predict(config, weights, x[32:], want, tmp_path)


def test_global_max_pool3d_flatten_exports_to_onnx(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((4, 6, 6, 2)),
            L.Conv3D(3, (2, 3, 3), dilation_rate=(1, 2, 1)),
            L.MaxPooling3D((1, 2, 2), strides=(1, 1, 2)),
            L.Flatten(),
            L.Dense(2),
        ]
    )
    branch = keras.Sequential([L.Input((4, 6, 6, 2)), L.GlobalMaxPooling3D(keepdims=True)])
    for model in (km, branch):
        model.save(tmp_path / "m.keras")
        spec = keras_model.load(str(tmp_path / "m.keras"))
        config, weights = spec.keras_config(), model.get_weights()
        x = rng.normal(size=(3, 4, 6, 6, 2)).astype(np.float32)
        write_onnx(tmp_path / "m.onnx", config, weights)
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        (got,) = sess.run(None, {"input": x})
        np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=2e-5)


@pytest.mark.parametrize(
    "layer,arg",
    [
        (L.Conv3D(4, 3, data_format="channels_first"), "data_format"),
        (L.Conv3D(4, 3, groups=2), "groups"),
    ],
)
def test_conv3d_refuses_by_name(layer, arg, tmp_path):
    km = keras.Sequential([L.Input((4, 6, 6, 4)), layer, L.Flatten(), L.Dense(1)])
    km.save(tmp_path / "m.keras")
    with pytest.raises(InvalidSpec, match=f"Conv3D.*{arg}"):
        keras_model.load(str(tmp_path / "m.keras"))
