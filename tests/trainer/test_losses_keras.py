"""The loss registry (``engine.losses``) against real Keras: for each loss and argument set, the
value and the gradient with respect to the model's output (the logits where an activation is
folded) equal ``keras.losses.X(...)`` and ``tf.GradientTape``'s, in float32; then one short SGD
run per family on a tiny model Keras built equals ``train_on_batch``'s losses."""

import json
import os
import zipfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf

from ringtrain_trainer.engine import loss_spec as LSP
from ringtrain_trainer.engine import losses as LS
from ringtrain_trainer.engine.program import Program
from ringtrain_trainer.keras import load as KM

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)

B = 6

# (Keras class, config, output activation folded into the loss or None, label kind, k)
CASES = [
    ("SparseCategoricalCrossentropy", {"from_logits": True}, None, "ids", 4),
    ("SparseCategoricalCrossentropy", {"from_logits": False}, "softmax", "ids", 4),
    ("SparseCategoricalCrossentropy", {"from_logits": True, "ignore_class": 1}, None, "ids", 4),
    ("CategoricalCrossentropy", {"from_logits": True}, None, "onehot", 4),
    ("CategoricalCrossentropy", {"from_logits": False}, "softmax", "onehot", 4),
    ("CategoricalCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, None, "onehot", 4),
    ("CategoricalCrossentropy", {"label_smoothing": 0.2}, "softmax", "onehot", 5),
    ("BinaryCrossentropy", {"from_logits": True}, None, "bits", 1),
    ("BinaryCrossentropy", {"from_logits": False}, "sigmoid", "bits", 3),
    ("BinaryCrossentropy", {"from_logits": True, "label_smoothing": 0.2}, None, "bits", 3),
    ("BinaryCrossentropy", {"label_smoothing": 0.1}, "sigmoid", "bits", 1),
    ("MeanSquaredError", {}, None, "float", 3),
    ("MeanAbsoluteError", {}, None, "float", 2),
    ("Huber", {}, None, "float", 3),
    ("Huber", {"delta": 0.3}, None, "float", 1),
]


def labels(kind, k, rng):
    if kind == "ids":
        return rng.integers(0, k, B)
    if kind == "onehot":
        return np.eye(k, dtype=np.float32)[rng.integers(0, k, B)]
    if kind == "bits":
        return rng.integers(0, 2, (B, k)).astype(np.float32)
    return rng.normal(0, 1, (B, k)).astype(np.float32)


def keras_value_and_grad(cls, cfg, act, z, y):
    zt = tf.Variable(z)
    with tf.GradientTape() as tape:
        out = getattr(keras.activations, act)(zt) if act else zt
        value = getattr(keras.losses, cls)(**cfg)(y, out)
    return float(value), tape.gradient(value, zt).numpy()


@pytest.mark.parametrize("cls, cfg, act, kind, k", CASES, ids=lambda v: str(v))
def test_value_and_gradient_equal_keras(cls, cfg, act, kind, k, rng):
    spec = LSP.fold(LSP.parse({"class_name": cls, "config": cfg}), act)
    assert spec.folded == act
    z = rng.normal(0, 2, (B, k)).astype(np.float32)
    y = labels(kind, k, rng)
    want, want_grad = keras_value_and_grad(cls, cfg, act, z, y)
    loss = LS.Loss(spec, B, k)
    np.copyto(loss.labels, y)
    got = loss.step(z)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(loss.grad, want_grad, rtol=1e-4, atol=1e-6)
    # the evaluators' float64 path: the same value, summed over the rows
    rows = B if "ignore_class" not in cfg else np.count_nonzero(y != cfg["ignore_class"])
    assert loss.total(z, y) / rows == pytest.approx(want, rel=1e-5, abs=1e-6)


def _step_peak_bytes(spec, kind, b, k, rng):
    import tracemalloc

    loss = LS.Loss(spec, b, k)
    y = rng.integers(0, k, b) if kind == "ids" else (rng.random((b, k)) > 0.5)
    np.copyto(loss.labels, y)
    z = rng.normal(0, 1, (b, k)).astype(np.float32)
    loss.step(z)
    tracemalloc.start()
    loss.step(z)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_a_training_step_allocates_nothing_proportional_to_the_batch(rng):
    """numpy's reductions keep a fixed-size buffer (8192 elements) whatever the batch; the
    sparse entries' fancy-indexed pick is one value per row, as before the registry."""
    for cls, cfg, act, kind, _ in CASES:
        spec = LSP.fold(LSP.parse({"class_name": cls, "config": cfg}), act)
        small = _step_peak_bytes(spec, kind, 256, 64, rng)
        big = _step_peak_bytes(spec, kind, 4096, 64, rng)
        assert big - small < 24 * (4096 - 256), (cls, small, big)  # not the 64 values a row


def test_a_training_step_allocates_nothing_new(rng):
    for cls, cfg, act, kind, k in CASES:
        loss = LS.Loss(LSP.fold(LSP.parse({"class_name": cls, "config": cfg}), act), B, k)
        np.copyto(loss.labels, labels(kind, k, rng))
        z = rng.normal(0, 1, (B, k)).astype(np.float32)
        before = {id(v) for v in vars(loss).values() if isinstance(v, np.ndarray)}
        loss.step(z)
        loss.step(z)
        after = {id(v) for v in vars(loss).values() if isinstance(v, np.ndarray)}
        assert before == after, cls


@pytest.mark.parametrize(
    "alias, cls",
    [
        ("mse", "MeanSquaredError"),
        ("mean_squared_error", "MeanSquaredError"),
        ("mae", "MeanAbsoluteError"),
        ("huber", "Huber"),
        ("binary_crossentropy", "BinaryCrossentropy"),
        ("categorical_crossentropy", "CategoricalCrossentropy"),
        ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy"),
        ("MeanSquaredError", "MeanSquaredError"),
    ],
)
def test_both_keras_spellings_name_the_same_entry(alias, cls):
    assert LSP.parse(alias).name == cls
    # compile(loss=<the function>) as Keras' compile_config records it
    if alias[0].islower():
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        m.compile("sgd", keras.losses.get(alias))
        assert LSP.parse(m.get_compile_config()["loss"]).name == cls
    # the class form as Keras itself serializes it
    doc = keras.losses.serialize(keras.losses.get(alias))
    doc = doc if isinstance(doc, dict) else {"class_name": doc}
    if isinstance(doc, dict) and doc.get("class_name") in LSP.SUPPORTED:
        assert LSP.parse(doc).name == cls


# -- end to end: a tiny .keras model, ten SGD steps, the same losses as train_on_batch ----------


def _mlp(out_units, out_act, loss, metrics):
    keras.utils.set_random_seed(3)
    m = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(out_units, activation=out_act),
        ]
    )
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics)
    return m


FAMILIES = {
    "regression-mse": (lambda: _mlp(2, "linear", "mse", ["mae"]), "float", 2),
    "binary-sigmoid": (
        lambda: _mlp(1, "sigmoid", "binary_crossentropy", ["accuracy"]),
        "bits",
        1,
    ),
    "onehot-softmax-smoothed": (
        lambda: _mlp(
            3,
            "softmax",
            keras.losses.CategoricalCrossentropy(label_smoothing=0.1),
            ["accuracy"],
        ),
        "onehot",
        3,
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ten_sgd_steps_equal_keras_train_on_batch(family, tmp_path, rng):
    make, kind, k = FAMILIES[family]
    km = make()
    path = tmp_path / "m.keras"
    km.save(path)
    with zipfile.ZipFile(path) as z:
        assert json.loads(z.read("config.json"))["compile_config"]["loss"]
    spec = KM.load(str(path))
    flat = spec.init(0)
    views, grads = spec.views(flat), np.zeros_like(flat)
    gviews = spec.views(grads)
    prog = Program(spec, 8, train=True)
    ours, theirs = [], []
    for _ in range(10):
        x = rng.normal(0, 1, (8, 5)).astype(np.float32)
        y = labels(kind, k, rng)[:6]
        y = np.concatenate([y, labels(kind, k, rng)[:2]])
        np.copyto(prog.x, x)
        np.copyto(prog.labels, y)
        ours.append(prog.loss_and_dlogits(prog.forward(views)))
        for _ in prog.backward_pieces(views, gviews):
            pass
        flat -= np.float32(0.1) * grads
        theirs.append(float(km.train_on_batch(x, y, return_dict=True)["loss"]))
    np.testing.assert_allclose(ours, theirs, rtol=2e-4)
    assert ours[-1] < ours[0]
