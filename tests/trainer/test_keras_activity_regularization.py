"""Keras' ``ActivityRegularization`` trained by ringtrain and by Keras from the same ``.keras``
weights on the same batches: the logged loss (which includes ``(l1 Σ|x| + l2 Σx²) / batch``)
and the weights after a few SGD steps are Keras'; predict and the exports are the identity.

Imports TensorFlow (slow): one module holds these comparisons.
"""

import os

import numpy as np
import pytest
from support.keras_steps import train_beside_keras

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.load import load

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def test_activity_regularization_trains_like_keras(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((5,)),
            L.Dense(7, activation="tanh"),
            L.ActivityRegularization(l1=0.05, l2=0.2),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, steps=4, batch=8)
    try:
        np.testing.assert_allclose(ours, theirs, rtol=2e-5)
        h = km.layers[0](x[:8]).numpy()  # the term (about 0.4) is far above the tolerance
        assert 0.05 * np.abs(h).sum() / 8 + 0.2 * (h**2).sum() / 8 > 0.1
        weights = t.spec.keras_weights(t.params, t.ipu.state)
        for mine, want in zip(weights, km.get_weights(), strict=True):
            np.testing.assert_allclose(mine, want, atol=2e-6)
        config = t.spec.keras_config()
    finally:
        t.close()
    want = km.predict(x, verbose=0)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert type(back.layers[1]).__name__ == "ActivityRegularization"
    np.testing.assert_allclose(back.predict(x, verbose=0), want, atol=2e-6)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], want, atol=2e-6)


def test_activity_regularizer_on_layers_trains_like_keras(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 1)),
            L.Conv2D(3, 3, activation="relu", activity_regularizer="l2"),
            L.MaxPooling2D(),
            L.Flatten(activity_regularizer=keras.regularizers.L1(0.02)),
            L.Dense(6, activation="tanh", activity_regularizer=keras.regularizers.L1L2(0.01, 0.1)),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(64, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, steps=4, batch=8)
    try:
        np.testing.assert_allclose(ours, theirs, rtol=2e-5)
        weights = t.spec.keras_weights(t.params, t.ipu.state)
        for mine, want in zip(weights, km.get_weights(), strict=True):
            np.testing.assert_allclose(mine, want, atol=5e-6)
        config = t.spec.keras_config()
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert back.layers[2].activity_regularizer.get_config() == {"l1": pytest.approx(0.02)}
    np.testing.assert_allclose(back.predict(x, verbose=0), km.predict(x, verbose=0), atol=2e-6)


@pytest.mark.parametrize(
    "layers, match",
    [
        ([L.Dense(3, activation="softmax", activity_regularizer="l2", name="d")], "'d' \\(Dense"),
        (
            [L.TimeDistributed(L.Dense(3, activity_regularizer="l2")), L.Flatten()],
            "activity_regularizer",
        ),
        (
            [L.TimeDistributed(L.ActivityRegularization(0.1)), L.Flatten()],
            "layer='ActivityRegularization'",
        ),
        ([L.TimeDistributed(L.GaussianNoise(0.1)), L.Flatten()], "layer='GaussianNoise'"),
    ],
)
def test_activity_regularizer_refusals_name_the_layer(layers, match, tmp_path):
    km = keras.Sequential([L.Input((2, 4)), L.Dense(4), *layers])
    km.save(tmp_path / "m.keras")
    with pytest.raises(InvalidSpec, match=match):
        load(str(tmp_path / "m.keras"))
