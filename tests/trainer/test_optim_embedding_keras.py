"""The optimizers that square the gradient (Adam, AdamW, RMSprop, Adagrad) on an Embedding
table, against real Keras: Keras gets the table's gradient as ``IndexedSlices`` with one slice
per token occurrence and squares each before summing duplicate ids (``optim/sparse_rows.py``),
so a row read k times gets ``Σ g_i²`` in its second moment. ringtrain's Trainer, on the same
``.keras`` file and batches (a vocabulary of 6 over 10 positions: every batch repeats ids),
must end every step at Keras' weights, with one program and with the batch split over 2
replicas × 2 host threads (4 programs, each squaring its own occurrences)."""

import io
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)
L = keras.layers
VOCAB, SEQ, CLASSES, STEPS = 6, 10, 3, 3

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.02, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.3, initial_accumulator_value=1e-3),
    "nadam": lambda: keras.optimizers.Nadam(0.05),
    "lion": lambda: keras.optimizers.Lion(0.02),
    "ftrl": lambda: keras.optimizers.Ftrl(0.3, l1_regularization_strength=0.01),
}


def _model(opt):
    keras.utils.set_random_seed(4)
    m = keras.Sequential(
        [
            L.Input((SEQ,), dtype="int32"),
            L.Embedding(VOCAB, 4),
            L.GlobalAveragePooling1D(),
            L.Dense(CLASSES),
        ]
    )
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def test_keras_squares_each_occurrence_of_an_embedding_row():
    """The premise, pinned on Keras itself: one Adam step on an ``IndexedSlices`` gradient
    with a duplicate id moves the row as the sum-of-squares rule says, not as the dense
    gradient's square does."""
    var = keras.Variable(np.zeros((2, 1), np.float32))
    opt = keras.optimizers.Adam(0.1, epsilon=1e-12)
    g = tf.IndexedSlices(tf.constant([[1.0], [1.0]]), tf.constant([0, 0]), tf.constant([2, 1]))
    opt.apply([g], [var])
    # m = 0.1 * 2, v = 0.001 * (1 + 1); step = lr * m_hat / sqrt(v_hat) = 0.1 * 2 / sqrt(2)
    assert float(var.numpy()[0, 0]) == pytest.approx(-0.1 * 2 / np.sqrt(2), rel=1e-5)
    assert float(var.numpy()[1, 0]) == 0.0


@pytest.mark.parametrize("split", [[], ["--ipus-per-worker", "2", "--ipu-host-threads", "2"]])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_embedding_table_follows_keras_step_by_step(name, split, tmp_path, monkeypatch):
    from ringtrain_trainer import worker

    monkeypatch.setattr(worker, "MIN_SHARD_FLOPS", 0)  # this small batch: still two shards

    km = _model(OPTIMIZERS[name]())
    km.save(tmp_path / "m.keras")
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (40, SEQ))
    y = (x[:, 0] % CLASSES).astype(np.int64)
    data = Dataset(
        "tokens",
        Split(x[:32].astype(np.float32), y[:32]),
        Split(x[32:].astype(np.float32), y[32:]),
        CLASSES,
    )
    args = ["--model", str(tmp_path / "m.keras"), "--steps", str(STEPS), "--batch-size", "8"]
    args += ["--ipu-host-threads", "1", *split]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), data, out=io.StringIO())
    try:
        assert (t.optimizer.sparse is not None) == t.optimizer.squares
        for step in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            t.train_one_step()
            km.train_on_batch(x[idx], y[idx])
            got = t.spec.keras_weights(t.params, t.state)
            for w, k in zip(got, km.get_weights(), strict=True):
                np.testing.assert_allclose(w, k, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    finally:
        t.close()


@pytest.mark.parametrize("clip", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_clipping_an_embedding_gradient_is_refused_before_anything_runs(clip, tmp_path):
    """Keras clips each occurrence's slice; ringtrain has only the reduced sum: refused, with
    the field's name (measured 1e-2 to 1.3 relative weight differences in 3 steps)."""
    _model(keras.optimizers.SGD(0.1, **{clip: 0.5})).save(tmp_path / "m.keras")
    args = ["--model", str(tmp_path / "m.keras"), "--steps", "1", "--batch-size", "8"]
    x = np.zeros((16, SEQ), np.float32)
    data = Dataset("tokens", Split(x, np.zeros(16, np.int64)), Split(x, np.zeros(16)), CLASSES)
    where = rf"compile_config\.optimizer\.config\.{clip}=0\.5 .*Embedding"
    with pytest.raises(InvalidSpec, match=where):
        Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), data, out=io.StringIO())


@pytest.mark.parametrize("name", ["Adamax", "Adadelta"])
def test_adamax_or_adadelta_on_an_embedding_is_refused_before_anything_runs(name, tmp_path):
    """Keras' Adamax takes |g| of each occurrence's slice, Adadelta squares each occurrence's
    update; ringtrain has only the sum."""
    _model(getattr(keras.optimizers, name)(0.1)).save(tmp_path / "m.keras")
    args = ["--model", str(tmp_path / "m.keras"), "--steps", "1", "--batch-size", "8"]
    x = np.zeros((16, SEQ), np.float32)
    data = Dataset("tokens", Split(x, np.zeros(16, np.int64)), Split(x, np.zeros(16)), CLASSES)
    with pytest.raises(InvalidSpec, match=rf"compile_config\.optimizer\.class_name='{name}'"):
        Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), data, out=io.StringIO())
