"""The model zoo: models Keras users bring, built and compiled by real Keras 3, each with a
small, learnable synthetic data set.

Used by tests/trainer/test_zoo.py (ringtrain over a real ring against Keras itself) and by
``hack/bench-zoo`` (samples/s next to TensorFlow). Each entry is a builder (a compiled
``keras.Model``, weights drawn from a fixed seed), a data generator (the four ``.npz`` arrays)
and whether a layer couples the examples of a batch (BatchNormalization: N workers × B is then
not 1 worker × N·B). Together the entries compile every optimizer ringtrain reads (SGD with
momentum and nesterov, Adam with amsgrad, AdamW, RMSprop, Adagrad) and every schedule, and
every loss family (sparse/categorical/binary cross-entropy, MSE, MAE, Huber), on flat outputs
and on a tag per timestep (a loss per position).

Keras is imported inside the builders: importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: examples per split: enough for a few global batches, small enough for seconds per model
N_TRAIN, N_TEST = 96, 32


@dataclass(frozen=True)
class Entry:
    name: str
    family: str
    build: Callable[[], object]
    data: Callable[[np.random.Generator], dict[str, np.ndarray]]
    #: a layer mixes the examples of a batch (BatchNormalization): per-worker batches differ
    batch_coupled: bool = False
    #: a measured disagreement with Keras, once ringtrain accepts the model: its comparison is
    #: a strict xfail (it fails the suite the day it passes, so the note cannot go stale)
    known_gap: str | None = None


def _splits(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "x_train": x[:N_TRAIN],
        "y_train": y[:N_TRAIN],
        "x_test": x[N_TRAIN:],
        "y_test": y[N_TRAIN:],
    }


def _n() -> int:
    return N_TRAIN + N_TEST


# -- data: learnable, deterministic given the generator ----------------------------------------
def table_regression(rng):
    x = rng.normal(0, 1, (_n(), 6)).astype(np.float32)
    w = rng.normal(0, 1, (6, 2)).astype(np.float32)
    return _splits(x, (np.tanh(x @ w) + 0.05 * rng.normal(0, 1, (_n(), 2))).astype(np.float32))


def table_scalar_target(rng):
    x = rng.normal(0, 1, (_n(), 5)).astype(np.float32)
    return _splits(x, (x[:, 0] * 2 - x[:, 1]).astype(np.float32))  # (n,) targets, output (n, 1)


def table_binary(rng):
    x = rng.normal(0, 1, (_n(), 5)).astype(np.float32)
    return _splits(x, (x @ np.arange(1, 6, dtype=np.float32) > 0).astype(np.int64))  # 0/1 (n,)


def blobs_onehot(rng, k=4):
    c = rng.integers(0, k, _n())
    x = (rng.normal(0, 1, (k, 8))[c] + 0.7 * rng.normal(0, 1, (_n(), 8))).astype(np.float32)
    return _splits(x, np.eye(k, dtype=np.float32)[c])


def quadrant_images(rng, size=12, k=3, channels=1):
    """uint8 images whose class is which third of the image is bright (fed raw to Rescaling)."""
    c = rng.integers(0, k, _n())
    x = rng.integers(0, 90, (_n(), size, size, channels))
    band = size // k
    for i, ci in enumerate(c):
        x[i, ci * band : (ci + 1) * band] += 140
    return _splits(x.astype(np.uint8), c.astype(np.int64))


def token_ids(rng, vocab=40, seq=12):
    """Int token ids; positive when a "signal" token (< 5) appears at least twice."""
    x = rng.integers(0, vocab, (_n(), seq)).astype(np.int32)
    return _splits(x, ((x < 5).sum(axis=1) >= 2).astype(np.int64))


def token_classes(rng, vocab=30, seq=8, k=3):
    x = rng.integers(0, vocab, (_n(), seq)).astype(np.int32)
    return _splits(x, (x[:, 0] % k).astype(np.int64))


def token_tags(rng, vocab=30, seq=8, k=3):
    """Int token ids and a tag per token, from the token and its left neighbour."""
    x = rng.integers(0, vocab, (_n(), seq)).astype(np.int32)
    left = np.concatenate([np.zeros((_n(), 1), np.int32), x[:, :-1]], axis=1)
    return _splits(x, ((x + left) % k).astype(np.int64))


def sequences(rng, steps=10, features=3):
    x = rng.normal(0, 1, (_n(), steps, features)).astype(np.float32)
    return _splits(x, x[:, :, 0].mean(axis=1, keepdims=True).astype(np.float32))


# -- builders -----------------------------------------------------------------------------------
def _seeded(seed: int = 7):
    import keras

    keras.utils.set_random_seed(seed)
    return keras


def regression_mlp():
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential([L.Input((6,)), L.Dense(16, activation="relu"), L.Dense(2)])
    lr = S.ExponentialDecay(0.05, decay_steps=4, decay_rate=0.8)
    m.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9, nesterov=True), loss="mse")
    return m


def regularized_mlp():
    """Keras' L1/L2 weight regularizers: their penalty in the loss, their gradient once."""
    keras = _seeded()
    L, R = keras.layers, keras.regularizers
    m = keras.Sequential(
        [
            L.Input((6,)),
            L.Dense(16, "relu", kernel_initializer="he_normal", kernel_regularizer=R.L2(0.02)),
            L.Dense(8, "tanh", kernel_regularizer=R.L1(0.01), bias_regularizer="l2"),
            L.Dense(2, kernel_regularizer=R.L1L2(0.001, 0.01)),
        ]
    )
    m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=1.0), loss="mse")
    return m


def huber_mlp():
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential([L.Input((5,)), L.Dense(8, activation="tanh"), L.Dense(1)])
    lr = S.PolynomialDecay(0.1, decay_steps=10, end_learning_rate=0.01, power=2.0)
    m.compile(optimizer=keras.optimizers.Adagrad(lr), loss=keras.losses.Huber(delta=0.5))
    return m


def mae_mlp():
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential([L.Input((5,)), L.Dense(8, activation="sigmoid"), L.Dense(1)])
    lr = S.InverseTimeDecay(0.01, decay_steps=2, decay_rate=0.5)
    m.compile(optimizer=keras.optimizers.RMSprop(lr, momentum=0.5, clipvalue=0.5), loss="mae")
    return m


def binary_mlp():
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential(
        [L.Input((5,)), L.Dense(12, activation="tanh"), L.Dense(1, activation="sigmoid")]
    )
    lr = S.PiecewiseConstantDecay([4], [0.02, 0.005])
    m.compile(optimizer=keras.optimizers.Adam(lr, amsgrad=True), loss="binary_crossentropy")
    return m


def onehot_mlp():
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential(
        [L.Input((8,)), L.Dense(16, activation="relu"), L.Dense(4, activation="softmax")]
    )
    lr = S.CosineDecay(0.001, decay_steps=10, warmup_target=0.01, warmup_steps=3)
    opt = keras.optimizers.AdamW(lr, weight_decay=0.01, global_clipnorm=1.0)
    m.compile(optimizer=opt, loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1))
    return m


def seeds_cnn():
    """The seeds' CNN shape, small: uint8 pixels into Rescaling, conv, pool, dense."""
    keras = _seeded()
    L, S = keras.layers, keras.optimizers.schedules
    m = keras.Sequential(
        [
            L.Input((12, 12, 1)),
            L.Rescaling(1 / 255),
            L.Conv2D(4, 3, activation="relu"),
            L.MaxPooling2D(2),
            L.Flatten(),
            L.Dense(16, activation="relu"),
            L.Dense(3, activation="softmax"),
        ]
    )
    lr = S.CosineDecayRestarts(0.02, first_decay_steps=3)
    opt = keras.optimizers.SGD(lr, momentum=0.9, clipnorm=1.0)
    m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return m


def bn_cnn():
    keras = _seeded()
    L = keras.layers
    m = keras.Sequential(
        [
            L.Input((12, 12, 1)),
            L.Rescaling(1 / 255),
            L.Conv2D(4, 3, padding="same", use_bias=False),  # BN's beta is the bias
            L.BatchNormalization(momentum=0.8),
            L.ReLU(),
            L.GlobalAveragePooling2D(),
            L.Dense(3),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    return m


def resnet_add():
    keras = _seeded()
    L = keras.layers
    x = inp = L.Input((12, 12, 1))
    x = L.Rescaling(1 / 255)(x)
    x = L.Conv2D(6, 3, padding="same", activation="relu")(x)
    y = L.Conv2D(6, 3, padding="same", activation="relu")(x)
    y = L.Conv2D(6, 3, padding="same")(y)
    x = L.Activation("relu")(L.Add()([x, y]))
    out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling2D()(x))
    m = keras.Model(inp, out)
    m.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="sparse_categorical_crossentropy"
    )
    return m


def mobilenet_block():
    keras = _seeded()
    L = keras.layers
    x = inp = L.Input((12, 12, 1))
    x = L.Rescaling(1 / 255)(x)
    x = L.Conv2D(8, 1, activation="relu")(x)
    x = L.DepthwiseConv2D(3, padding="same", activation="relu")(x)
    x = L.SeparableConv2D(8, 3, strides=2, padding="same", activation="relu")(x)
    out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling2D()(x))
    m = keras.Model(inp, out)
    m.compile(optimizer=keras.optimizers.RMSprop(0.005), loss="sparse_categorical_crossentropy")
    return m


def embedding_text():
    keras = _seeded()
    L = keras.layers
    m = keras.Sequential(
        [
            L.Input((12,), dtype="int32"),
            L.Embedding(40, 8),
            L.GlobalAveragePooling1D(),
            L.Dense(1, activation="sigmoid"),
        ]
    )
    m.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy")
    return m


def conv1d_text():
    keras = _seeded()
    L = keras.layers
    m = keras.Sequential(
        [
            L.Input((12,), dtype="int32"),
            L.Embedding(40, 8),
            L.Conv1D(8, 3, padding="same", activation="relu"),
            L.GlobalMaxPooling1D(),
            L.Dense(1, activation="sigmoid"),
        ]
    )
    m.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    return m


def lstm_regression():
    keras = _seeded()
    L = keras.layers
    m = keras.Sequential([L.Input((10, 3)), L.LSTM(8), L.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return m


def gru_classifier():
    keras = _seeded()
    L = keras.layers
    m = keras.Sequential([L.Input((8,), dtype="int32"), L.Embedding(30, 8), L.GRU(8), L.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m.compile(optimizer=keras.optimizers.RMSprop(0.01), loss=loss)
    return m


def gru_tagger():
    """A sequence tagger: a tag per timestep, a loss per position (Keras' rule)."""
    keras = _seeded()
    L = keras.layers
    dense = L.Dense(3, activation="softmax")
    m = keras.Sequential(
        [L.Input((8,), dtype="int32"), L.Embedding(30, 8), L.GRU(8, return_sequences=True),
         L.TimeDistributed(dense)]
    )  # fmt: skip
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return m


def transformer_block():
    keras = _seeded()
    L = keras.layers
    inp = L.Input((8,), dtype="int32")
    h = L.Embedding(30, 8)(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = L.LayerNormalization()(L.Add()([h, a]))
    f = L.Dense(8)(L.Dense(16, activation="gelu")(h))
    h = L.LayerNormalization()(L.Add()([h, f]))
    out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling1D()(h))
    m = keras.Model(inp, out)
    opt = keras.optimizers.AdamW(0.005, weight_decay=0.01)
    m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return m


def transfer_frozen():
    """Transfer learning: a MobileNetV2-like base without a top (conv-BN-ReLU6, depthwise-BN-
    ReLU6, project-BN), nested and frozen (its BatchNormalization in inference mode, so not
    batch-coupled), under a new head."""
    keras = _seeded()
    L = keras.layers
    i = L.Input((12, 12, 1))
    h = L.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(i)
    h = L.ReLU(6.0)(L.BatchNormalization()(h))
    h = L.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
    h = L.ReLU(6.0)(L.BatchNormalization()(h))
    base = keras.Model(i, L.BatchNormalization()(L.Conv2D(8, 1, use_bias=False)(h)), name="base")
    rng = np.random.default_rng(5)
    base.set_weights(
        [
            np.abs(rng.normal(1, 0.3, w.shape)) if "variance" in w.path else w.numpy()
            for w in base.weights
        ]
    )
    base.trainable = False
    inp = L.Input((12, 12, 1))
    h = base(L.Rescaling(1 / 255)(inp))
    m = keras.Model(inp, L.Dense(3, activation="softmax")(L.GlobalAveragePooling2D()(h)))
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return m


def siamese_shared():
    """One Dense tower shared by two views of the input (Siamese), called three times."""
    keras = _seeded()
    L = keras.layers
    inp = L.Input((8,))
    a, b = L.Dense(6)(inp), L.Dense(6, activation="tanh")(inp)
    tower = L.Dense(5, activation="relu")
    d = L.Subtract()([tower(a), tower(b)])
    out = L.Dense(4, activation="softmax")(L.Concatenate()([d, tower(a)]))
    m = keras.Model(inp, out)
    m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="categorical_crossentropy")
    return m


def convnext_block():
    """ConvNeXt's block as it writes it: a nested ``keras.Sequential`` in a residual."""
    keras = _seeded()
    L = keras.layers
    inp = L.Input((12, 12, 1))
    x = L.Conv2D(8, 2, strides=2)(L.Rescaling(1 / 255)(inp))
    block = keras.Sequential(
        [
            L.DepthwiseConv2D(3, padding="same"),
            L.LayerNormalization(epsilon=1e-6),
            L.Dense(16, activation="gelu"),
            L.Dense(8),
        ],
        name="block",
    )
    x = L.LayerNormalization(epsilon=1e-6)(L.GlobalAveragePooling2D()(L.Add()([x, block(x)])))
    m = keras.Model(inp, L.Dense(3, activation="softmax")(x))
    opt = keras.optimizers.AdamW(0.005, weight_decay=0.01)
    m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return m


ZOO: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("regression_mlp", "mlp", regression_mlp, table_regression),
        Entry("huber_mlp", "mlp", huber_mlp, table_scalar_target),
        Entry("mae_mlp", "mlp", mae_mlp, table_scalar_target),
        Entry("binary_mlp", "mlp", binary_mlp, table_binary),
        Entry("regularized_mlp", "mlp", regularized_mlp, table_regression),
        Entry("onehot_mlp", "mlp", onehot_mlp, blobs_onehot),
        Entry("seeds_cnn", "cnn", seeds_cnn, quadrant_images),
        Entry("bn_cnn", "cnn", bn_cnn, quadrant_images, batch_coupled=True),
        Entry("resnet_add", "resnet", resnet_add, quadrant_images),
        Entry("mobilenet_block", "mobilenet", mobilenet_block, quadrant_images),
        Entry("embedding_text", "text", embedding_text, token_ids),
        Entry("conv1d_text", "text", conv1d_text, token_ids),
        Entry("lstm_regression", "rnn", lstm_regression, sequences),
        Entry("gru_classifier", "rnn", gru_classifier, token_classes),
        Entry("gru_tagger", "tagger", gru_tagger, token_tags),
        Entry("transformer_block", "transformer", transformer_block, token_classes),
        Entry("transfer_frozen", "transfer", transfer_frozen, quadrant_images),
        Entry("siamese_shared", "shared", siamese_shared, blobs_onehot),
        Entry("convnext_block", "convnext", convnext_block, quadrant_images),
    )
}


def save(entry: Entry, directory) -> tuple[str, str]:
    """``entry``'s model as ``NAME.keras`` and its data as ``NAME.npz`` in ``directory``."""
    from pathlib import Path

    d = Path(directory)
    model, data = d / f"{entry.name}.keras", d / f"{entry.name}.npz"
    entry.build().save(model)
    np.savez(data, **entry.data(np.random.default_rng(11)))
    return str(model), str(data)


def acceptance(directory) -> dict[str, str | None]:
    """Per zoo model: None where ringtrain accepts its ``.keras`` file and its data, else the
    refusal's words (a refusal before anything runs, naming the layer, argument or array)."""
    from ringtrain.errors import DataError, InvalidSpec
    from ringtrain_trainer.data.npz import fit_model, load_npz
    from ringtrain_trainer.keras import load as KM

    out: dict[str, str | None] = {}
    for name, entry in ZOO.items():
        model, data = save(entry, directory)
        try:
            fit_model(load_npz(data), KM.load(model), data)
            out[name] = None
        except (InvalidSpec, DataError) as e:
            out[name] = str(e)
    return out
