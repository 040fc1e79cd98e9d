"""Keras layers' initializers and weight regularizers, against real Keras.

Initializers: a model without starting weights (a config) with ``he_normal``, ``orthogonal``
and friends on Dense, Conv2D, Embedding, LSTM and LayerNormalization is accepted, and
ringtrain's fresh weights have each initializer's distribution (moments, bounds, structure).

Regularizers: a model with L1 on a conv kernel and L2 on a Dense kernel and bias, trained by
ringtrain and by Keras from the same ``.keras`` weights on the same batches, reports Keras'
loss (which includes the penalty) at every step and ends at Keras' weights; the export carries
the regularizers back into a config Keras reloads.
"""

import io
import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.export import write_keras
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L, R = keras.layers, keras.regularizers
STEPS, BATCH = 4, 8


def _fresh(tmp_path, layers, seed=3):
    km = keras.Sequential(layers)
    (tmp_path / "m.json").write_text(km.to_json())
    spec = keras_model.load(str(tmp_path / "m.json"))
    return spec, spec.views(spec.init(seed))


def test_fresh_weights_follow_each_layers_initializer(tmp_path):
    _, v = _fresh(
        tmp_path,
        [
            L.Input((12,), dtype="int32"),
            L.Embedding(50, 64, embeddings_initializer=keras.initializers.RandomNormal(0, 0.3)),
            L.LSTM(32, kernel_initializer="he_uniform", recurrent_initializer="orthogonal"),
            L.LayerNormalization(gamma_initializer=keras.initializers.Constant(0.5)),
            L.Dense(300, kernel_initializer="he_normal", bias_initializer="ones"),
            L.Dense(200, kernel_initializer="orthogonal", bias_initializer="zeros"),
            L.Dense(5, kernel_initializer="lecun_uniform"),
        ],
    )
    emb, lstm, ln, d1, d2, d3 = v
    assert emb["embeddings"].std() == pytest.approx(0.3, rel=0.03)
    assert abs(emb["embeddings"].mean()) < 0.01
    limit = math.sqrt(6.0 / 64)  # he_uniform: fan_in 64
    assert np.abs(lstm["kernel"]).max() <= limit
    assert lstm["kernel"].std() == pytest.approx(limit / math.sqrt(3), rel=0.03)
    rk = lstm["recurrent_kernel"]  # (32, 128): orthonormal rows
    np.testing.assert_allclose(rk @ rk.T, np.eye(32), atol=1e-5)
    np.testing.assert_array_equal(ln["gamma"], 0.5)
    assert d1["kernel"].std() == pytest.approx(math.sqrt(2.0 / 32), rel=0.03)  # he_normal
    assert np.abs(d1["kernel"]).max() <= 2 * math.sqrt(2.0 / 32) / 0.8796 + 1e-6
    np.testing.assert_array_equal(d1["bias"], 1.0)
    k2 = d2["kernel"]  # (300, 200): orthonormal columns
    np.testing.assert_allclose(k2.T @ k2, np.eye(200), atol=1e-4)
    assert np.abs(d3["kernel"]).max() <= math.sqrt(3.0 / 200)  # lecun_uniform
    assert d3["kernel"].std() == pytest.approx(math.sqrt(1.0 / 200), rel=0.15)


def test_conv_initializers_are_accepted_and_drawn(tmp_path):
    _, v = _fresh(
        tmp_path,
        [
            L.Input((10, 10, 8)),
            L.Conv2D(64, 3, kernel_initializer="he_normal", padding="same"),
            L.Conv2D(
                16,
                3,
                kernel_initializer=keras.initializers.VarianceScaling(0.5, "fan_out", "uniform"),
            ),
            L.Flatten(),
            L.Dense(3),
        ],
    )
    assert v[0]["kernel"].std() == pytest.approx(math.sqrt(2.0 / 72), rel=0.03)
    limit = math.sqrt(3 * 0.5 / (9 * 16))
    assert np.abs(v[1]["kernel"]).max() <= limit
    assert v[1]["kernel"].std() == pytest.approx(limit / math.sqrt(3), rel=0.05)


def test_default_initializers_draw_what_they_drew_before(tmp_path):
    """Keras' defaults keep the old Glorot path: the presets' fresh weights are unchanged."""
    spec, _ = _fresh(tmp_path, [L.Input((6,)), L.Dense(4, kernel_initializer="glorot_uniform")])
    assert all(s.spec.init is None for s in spec.slots)


def test_unsupported_initializer_and_regularizer_are_refused(tmp_path):
    with pytest.raises(InvalidSpec, match="kernel_regularizer"):
        _fresh(tmp_path, [L.Input((6,)), L.Dense(4, kernel_regularizer=R.OrthogonalRegularizer())])
    with pytest.raises(InvalidSpec, match="moving_mean_initializer"):
        _fresh(tmp_path, [L.Input((6,)), L.BatchNormalization(moving_mean_initializer="ones")])


def _model():
    return keras.Sequential(
        [
            L.Input((8, 8, 2)),
            L.Conv2D(4, 3, activation="relu", kernel_regularizer=R.L1(0.01)),
            L.MaxPooling2D(2),
            L.Conv2D(3, 2, padding="same", kernel_regularizer=R.L1L2(0.002, 0.01)),
            L.Flatten(),
            L.Dense(8, activation="relu", kernel_regularizer=R.L2(0.05), bias_regularizer="l2"),
            L.Dense(3, activation="softmax"),
        ]
    )


def test_regularized_model_trains_like_keras_and_exports_its_regularizers(tmp_path, rng):
    km = _model()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    km.save(tmp_path / "m.keras")
    x = rng.random((48, 8, 8, 2)).astype(np.float32)
    y = rng.integers(0, 3, 48)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--ipu-host-threads", "1"]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--json"]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    try:
        assert len(t.optimizer.regs) == 4, "the regularizers reach the optimizer"
        assert "+ the L1/L2 penalty of 4 weight tensors" in t.training_line()
        for step in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            want = float(km.train_on_batch(x[idx], y[idx]))
            print(
                json.dumps(
                    {
                        "test": "regularized-vs-keras",
                        "step": step + 1,
                        "ringtrain": loss,
                        "keras": want,
                        "penalty": t.optimizer.penalty,
                    }
                )
            )
            assert t.optimizer.penalty > 0
            assert loss == pytest.approx(want, rel=1e-4)
        mine = t.spec.keras_weights(t.params, t.ipu.state)
        for a, b in zip(mine, km.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5)
        config, weights = t.spec.keras_config(), mine
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    conv, dense = back.layers[0], back.layers[4]
    assert isinstance(conv.kernel_regularizer, R.L1)
    assert float(conv.kernel_regularizer.l1) == pytest.approx(0.01)
    assert isinstance(dense.kernel_regularizer, R.L2)
    assert float(dense.kernel_regularizer.l2) == pytest.approx(0.05)
    assert float(dense.bias_regularizer.l2) == pytest.approx(0.01)


def _everywhere():
    r = {"kernel_regularizer": R.L2(0.01), "bias_regularizer": R.L1(0.02)}
    return [
        L.Input((12,), dtype="int32"),
        L.Embedding(30, 8, embeddings_regularizer=R.L1(0.003)),
        L.Conv1D(8, 3, padding="same", **r),
        L.SeparableConv1D(
            8,
            3,
            padding="same",
            depthwise_regularizer="l1",
            pointwise_regularizer="l2",
            bias_regularizer="l2",
        ),
        L.LayerNormalization(gamma_regularizer=R.L2(0.1), beta_regularizer=R.L1(0.1)),
        L.LSTM(6, return_sequences=True, recurrent_regularizer=R.L1L2(0.01, 0.02), **r),
        L.Bidirectional(L.GRU(4, return_sequences=True, kernel_regularizer=R.L2(0.3))),
        L.MultiHeadAttention(2, 4, kernel_regularizer=R.L2(0.05)),
        L.Flatten(),
        L.BatchNormalization(gamma_regularizer="l2"),
        L.Dense(3, **r),
    ]


def test_every_layers_penalty_is_keras_penalty(tmp_path, rng):
    """Each layer kind's regularizers reach its weights: ringtrain's penalty at the file's
    weights is the sum of Keras' ``model.losses``."""
    inp = _everywhere()
    x = inp[0]
    h = inp[1](x)
    for layer in inp[2:]:
        h = layer(h, h) if isinstance(layer, L.MultiHeadAttention) else layer(h)
    km = keras.Model(x, h)
    km.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    for w in km.trainable_weights:  # away from zero, where L1 is flat
        w.assign(rng.normal(0, 0.5, w.shape).astype(np.float32))
    km.save(tmp_path / "m.keras")
    spec = keras_model.load(str(tmp_path / "m.keras"))
    km(np.zeros((1, 12), np.int32))  # Keras computes its penalties on a call
    want = float(sum(float(v) for v in km.losses))
    assert spec.penalty(spec.initial[0]) == pytest.approx(want, rel=1e-5)
    regs = {s.spec.name for s in spec.slots if s.spec.reg is not None}
    assert {
        "embeddings",
        "depthwise_kernel",
        "pointwise_kernel",
        "recurrent_kernel",
        "gamma",
        "beta",
        "forward_kernel",
        "backward_kernel",
        "query_kernel",
    } <= regs


def test_a_regularized_embedding_under_adam_follows_keras(tmp_path, rng):
    """Keras adds the penalty's dense gradient to the table's IndexedSlices: duplicate ids are
    summed before Adam squares them, so a regularized table is not a sparse-rows table."""
    km = keras.Sequential(
        [
            L.Input((6,), dtype="int32"),
            L.Embedding(20, 4, embeddings_regularizer=R.L2(0.05)),
            L.GlobalAveragePooling1D(),
            L.Dense(3, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy")
    km.save(tmp_path / "m.keras")
    x = rng.integers(0, 5, (40, 6)).astype(np.int32)  # few ids: many duplicates per batch
    y = rng.integers(0, 3, 40)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--ipu-host-threads", "1"]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    try:
        for _ in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            assert loss == pytest.approx(float(km.train_on_batch(x[idx], y[idx])), rel=1e-4)
        for a, b in zip(t.spec.keras_weights(t.params, t.ipu.state), km.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5)
    finally:
        t.close()
