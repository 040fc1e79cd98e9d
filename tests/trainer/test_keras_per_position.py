"""A loss per position: models whose output is not flat — a tag per timestep (a GRU tagger,
sparse cross-entropy, ``ignore_class`` for the padding tag), a value per pixel (a convolutional
autoencoder reconstructing its input with binary cross-entropy on soft targets), a vector per
timestep (one-hot categorical cross-entropy, mse). Keras computes the loss over the last axis
at every position and averages over every position of every example; ringtrain must reach the
same loss at every step from the same ``.keras`` weights on the same batches, the same test
loss, accuracy and compiled metrics as ``model.evaluate``, and exports that Keras reloads and
onnxruntime runs to the same predictions. Labels of the wrong shape are refused by name."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import logits, train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.data.dataset import DataError
from ringtrain_trainer.engine.losses import Loss
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras import load as keras_model

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _tagger(rng):
    inp = keras.Input((7,), dtype="int32")
    x = L.Embedding(30, 6)(inp)
    x = L.GRU(5, return_sequences=True)(x)
    out = L.TimeDistributed(L.Dense(4, activation="softmax"))(x)
    km = keras.Model(inp, out)
    loss = keras.losses.SparseCategoricalCrossentropy(ignore_class=0)
    km.compile(keras.optimizers.Adam(0.02), loss, metrics=["accuracy"])
    x = rng.integers(1, 30, (48, 7)).astype(np.int32)
    y = (x % 4).astype(np.int32)  # tag 0 (the padding tag) ignored, as Keras
    return km, x, y


def _autoencoder(rng):
    inp = keras.Input((8, 8, 1))
    x = L.Conv2D(4, 3, activation="relu", padding="same")(inp)
    x = L.MaxPooling2D(2, padding="same")(x)
    x = L.Conv2DTranspose(4, 3, strides=2, activation="relu", padding="same")(x)
    out = L.Conv2D(1, 3, activation="sigmoid", padding="same")(x)
    km = keras.Model(inp, out)
    km.compile(keras.optimizers.Adam(0.01), "binary_crossentropy", metrics=["accuracy", "mae"])
    x = rng.random((48, 8, 8, 1)).astype(np.float32)
    return km, x, x  # reconstruct the input: soft targets in [0, 1]


def _onehot(rng):
    km = keras.Sequential(
        [
            keras.Input((6, 3)),
            L.Conv1D(5, 3, padding="same", activation="tanh"),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(keras.optimizers.SGD(0.5), "categorical_crossentropy", metrics=["accuracy"])
    x = rng.normal(size=(48, 6, 3)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[np.argmax(x, axis=-1)]
    return km, x, y


def _regression(rng):
    km = keras.Sequential([keras.Input((5, 4)), L.LSTM(6, return_sequences=True), L.Dense(2)])
    km.compile(keras.optimizers.RMSprop(0.01), "mse", metrics=["mae"])
    x = rng.normal(size=(48, 5, 4)).astype(np.float32)
    y = np.cumsum(x[..., :2], axis=1).astype(np.float32)
    return km, x, y


MODELS = {"tagger": _tagger, "autoencoder": _autoencoder, "onehot": _onehot, "mse": _regression}


def _as_keras(z: np.ndarray, folded: str | None) -> np.ndarray:
    """The program's output as Keras' predict returns it: the folded activation applied over
    the last axis."""
    if folded == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if folded == "softmax":
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return z


@pytest.mark.parametrize("name", list(MODELS))
def test_a_loss_per_position_trains_and_evaluates_like_keras(name, tmp_path, rng):
    keras.utils.set_random_seed(3)
    km, x, y = MODELS[name](rng)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, steps=4, batch=16, n_train=32)
    try:
        np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=1e-6)
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
        km.set_weights(weights)
        want = km.predict(x[32:], verbose=0)
        z = logits(t, x[32:])
        np.testing.assert_allclose(_as_keras(z, t.spec.loss.folded), want, rtol=1e-4, atol=2e-6)
        logs = km.evaluate(x[32:], y[32:], batch_size=16, verbose=0, return_dict=True)
        metric = t.spec.loss.metric
        assert t.evaluate() == pytest.approx(logs[metric], rel=1e-4, abs=1e-6)
        for k, v in (t.metrics.status().get("test_metrics") or {}).items():
            assert v == pytest.approx(logs[k], rel=1e-4, abs=1e-6), k
        if name != "tagger":  # Keras divides an ignore_class loss by each batch's valid rows
            loss = Loss(t.spec.loss, 16, z.shape[-1], np.float64)
            assert loss.total(z, t.data.test.labels) / 16 == pytest.approx(logs["loss"], rel=1e-4)
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    np.testing.assert_allclose(back.predict(x[32:], verbose=0), want, rtol=1e-4, atol=2e-6)
    if name in ("autoencoder", "onehot"):
        write_onnx(tmp_path / "m.onnx", config, weights)
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        (got,) = sess.run(None, {"input": x[32:]})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6)


def test_labels_not_shaped_like_the_output_are_refused_naming_the_shape(tmp_path, rng):
    km, x, y = _tagger(rng)
    km.save(tmp_path / "m.keras")
    spec = keras_model.load(str(tmp_path / "m.keras"))
    assert spec.loss.out_shape == (7, 4) and spec.loss.positions == 7
    from ringtrain_trainer.data.npz import fit_model, load_npz

    for bad in (y[:, :6], y[:, 0], np.eye(4, dtype=np.float32)[y]):
        np.savez(tmp_path / "d.npz", x_train=x, y_train=bad, x_test=x, y_test=bad)
        with pytest.raises(DataError, match=r"needs integer class ids \(n, 7\)"):
            fit_model(load_npz(tmp_path / "d.npz"), spec, "d.npz")


def test_a_per_position_output_among_several_is_refused_by_name(tmp_path):
    inp = keras.Input((6, 3))
    seq = L.Dense(2, name="tags")(inp)
    flat = L.Dense(2, name="cls")(L.Flatten()(inp))
    km = keras.Model(inp, [seq, flat])
    km.compile("adam", ["mse", "mse"])
    km.save(tmp_path / "m.keras")
    with pytest.raises(InvalidSpec, match=r"the output 'tags'.s shape is \(6, 2\)"):
        keras_model.load(str(tmp_path / "m.keras"))
