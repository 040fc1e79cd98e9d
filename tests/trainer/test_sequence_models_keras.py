"""Sequence models end to end against real Keras: a text classifier (int token ids →
Embedding → Bidirectional LSTM → GRU → Dense) and a transformer block (Functional: Embedding, causal
MultiHeadAttention, residual Adds, LayerNormalization, a per-position Dense), each saved by
Keras as a ``.keras`` file and trained by ringtrain's worker (1 worker) from those weights on
the same batches as ``train_on_batch``: the same loss at every step, and an export that Keras
and onnxruntime load with ringtrain's predictions."""

import io
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.export.onnx_file import write_onnx
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)
L = keras.layers
VOCAB, SEQ, CLASSES = 30, 8, 3


def text_rnn():
    return keras.Sequential(
        [
            L.Input((SEQ,), dtype="int32"),
            L.Embedding(VOCAB, 8),
            L.Bidirectional(L.LSTM(6, return_sequences=True)),
            L.GRU(5),
            L.Dense(CLASSES),
        ]
    )


def transformer_block():
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, 8)(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h, use_causal_mask=True)
    h = L.LayerNormalization()(L.Add()([h, a]))
    f = L.Dense(8)(L.Dense(16, activation="relu")(h))
    h = L.LayerNormalization()(L.Add()([h, f]))
    return keras.Model(inp, L.Dense(CLASSES)(L.Flatten()(h)))


def timeseries_transformer():
    """keras.io's "Timeseries classification with a Transformer" encoder: pre-norm attention
    and a Conv1D(kernel 1) feed-forward, pooled with ``data_format="channels_first"`` (the
    mean of each timestep's features)."""
    inp = keras.Input((SEQ,), dtype="int32")
    x = L.Embedding(VOCAB, 4)(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4)(L.LayerNormalization(epsilon=1e-6)(x), x)
    res = L.Add()([a, x])
    f = L.Conv1D(6, 1, activation="relu")(L.LayerNormalization(epsilon=1e-6)(res))
    x = L.Add()([L.Conv1D(4, 1)(f), res])
    x = L.GlobalAveragePooling1D(data_format="channels_first")(x)
    return keras.Model(inp, L.Dense(CLASSES)(L.Dense(8, activation="relu")(x)))


@pytest.mark.parametrize("build", [text_rnn, transformer_block, timeseries_transformer])
def test_training_from_a_keras_file_matches_keras_step_by_step(build, tmp_path, rng):
    keras.utils.set_random_seed(3)
    km = build()
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss=lossf)
    km.save(tmp_path / "m.keras")
    x = rng.integers(0, VOCAB, (48, SEQ))
    y = (x[:, 0] % CLASSES).astype(np.int64)  # learnable: the first token's class
    data = Dataset(
        "tokens",
        Split(x[:32].astype(np.float32), y[:32]),
        Split(x[32:].astype(np.float32), y[32:]),
        CLASSES,
    )
    args = ["--model", str(tmp_path / "m.keras"), "--steps", "5", "--batch-size", "8"]
    args += ["--optimizer", "sgd", "--lr", "0.1", "--ipu-host-threads", "1"]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--export", str(tmp_path / "out.keras")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), data, out=io.StringIO())
    try:
        for _ in range(5):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            assert loss == pytest.approx(float(km.train_on_batch(x[idx], y[idx])), rel=2e-4)
        want = km.predict(x[32:], verbose=0)
        assert t.evaluate() == float(np.mean(want.argmax(1) == y[32:]))
        exported = t.export(loss)
        weights = t.spec.keras_weights(t.params, t.state)
        onnx_path = write_onnx(tmp_path / "m.onnx", t.spec.keras_config(), weights)
    finally:
        t.close()
    got = keras.saving.load_model(exported, compile=False).predict(x[32:], verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    sess = ort.InferenceSession(str(onnx_path))
    (onnx_out,) = sess.run(None, {sess.get_inputs()[0].name: x[32:].astype(np.float32)})
    np.testing.assert_allclose(onnx_out, want, rtol=1e-4, atol=1e-5)
