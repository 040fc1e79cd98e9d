"""Keras ``Conv2DTranspose`` / ``Conv1DTranspose``: the op's gradients against finite
differences for each geometry, and models built by real Keras — a small convolutional
autoencoder (strided Conv2D down, Conv2DTranspose up, mse) and a U-Net-style skip — trained by
ringtrain and by Keras from the same ``.keras`` weights on the same batches (loss at every
step, weights after), the export reloaded by Keras and run by onnxruntime."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.opcheck import check_gradients

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import exports_predict, follows_keras, train_beside_keras

from ringtrain_trainer.engine.ops.convtranspose import ConvTranspose

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


@pytest.mark.parametrize(
    "op",
    [
        ConvTranspose((4, 4, 3), 2, (3, 3), (2, 2), "same", None, "tanh", True),
        ConvTranspose((3, 3, 2), 2, (3, 3), (2, 2), "valid", None, "linear", True),
        ConvTranspose((3, 3, 2), 2, (2, 2), (3, 3), "valid", None, "linear", False),
        ConvTranspose((3, 4, 2), 3, (3, 3), (2, 2), "same", [1, 0], "relu", True),
        ConvTranspose((5, 3), 4, (3,), (2,), "valid", [1], "linear", True),
        ConvTranspose((5, 3), 2, (4,), (1,), "same", None, "sigmoid", True),
    ],
    ids=["same-s2", "valid-s2", "k<s", "output_padding", "1d-valid-op", "1d-same-s1"],
)
def test_transposed_convolution_gradients(op, rng):
    check_gradients(op, rng)


def _autoencoder() -> keras.Model:
    x = L.Input((8, 8, 1))
    d1 = L.Conv2D(4, 3, strides=2, padding="same", activation="relu")(x)
    d2 = L.Conv2D(6, 3, strides=2, padding="same", activation="relu")(d1)
    u1 = L.Conv2DTranspose(4, 3, strides=2, padding="same", activation="relu")(d2)
    u1 = L.Concatenate()([u1, d1])  # the U-Net skip
    u2 = L.Conv2DTranspose(3, 2, strides=2, padding="valid")(u1)
    out = L.Conv2D(1, 1, activation="sigmoid")(u2)
    return keras.Model(x, out)


def _seq() -> keras.Model:
    return keras.Sequential(
        [
            L.Input((6, 2)),
            L.Conv1DTranspose(3, 3, strides=2, output_padding=1, activation="tanh"),
            L.Conv1DTranspose(2, 2, padding="same"),
            L.Flatten(),
            L.Dense(3, activation="softmax"),
        ]
    )


@pytest.mark.parametrize("name", ["autoencoder", "conv1d_transpose"])
def test_transposed_convolutions_train_like_keras_and_export(name, tmp_path, rng):
    if name == "autoencoder":
        ae = _autoencoder()
        km = keras.Model(ae.input, L.Flatten()(ae.output))  # ringtrain's outputs are flat
        km.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        x = rng.random((40, 8, 8, 1)).astype(np.float32)
        y = x.reshape(40, -1)  # reconstruct the input
    else:
        km = _seq()
        km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        x = rng.normal(size=(40, 6, 2)).astype(np.float32)
        y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 4, 8, n_train=32)
    try:
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    follows_keras(ours, theirs, weights, km, rtol=1e-4, atol=1e-5)
    want = km.predict(x[32:], verbose=0)
    exports_predict(config, weights, x[32:], want, tmp_path)
