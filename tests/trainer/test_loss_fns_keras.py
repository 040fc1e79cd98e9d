"""The regression and margin losses (``engine.loss_fns``) against real Keras: value and gradient
with respect to the model's output equal ``keras.losses.X`` and ``tf.GradientTape``'s in float32
(both spellings of each name reach the same entry), and a tiny ``.keras`` model compiled with
each trains through ten SGD steps with the losses ``train_on_batch`` reports."""

import os
import zipfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf

from ringtrain_trainer.engine import loss_fns
from ringtrain_trainer.engine import loss_spec as LSP
from ringtrain_trainer.engine import losses as LS
from ringtrain_trainer.engine.program import Program
from ringtrain_trainer.keras import load as KM

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)

B, K = 6, 4

# (Keras class, alias, the output the model would give, the labels)
CASES = [
    ("Poisson", "poisson", "positive", "counts"),
    ("LogCosh", "log_cosh", "any", "float"),
    ("KLDivergence", "kl_divergence", "probs", "probs"),
    ("KLDivergence", "kld", "any", "probs"),  # clipped outputs: no gradient there
    ("MeanSquaredLogarithmicError", "msle", "any", "positive"),
    ("MeanAbsolutePercentageError", "mape", "any", "float"),
    ("Hinge", "hinge", "any", "bits"),
    ("Hinge", "hinge", "any", "signs"),
    ("SquaredHinge", "squared_hinge", "any", "bits"),
    ("CategoricalHinge", "categorical_hinge", "any", "onehot"),
    ("CosineSimilarity", "cosine_similarity", "any", "float"),
]


def values(kind, rng, shape=(B, K)):
    if kind == "positive":
        return rng.uniform(0.05, 3, shape).astype(np.float32)
    if kind == "counts":
        return rng.poisson(1.5, shape).astype(np.float32)
    if kind == "probs":
        p = rng.uniform(0.01, 1, shape)
        return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    if kind == "bits":
        return rng.integers(0, 2, shape).astype(np.float32)
    if kind == "signs":
        return rng.choice([-1.0, 1.0], shape).astype(np.float32)
    if kind == "onehot":
        return np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], shape[0])]
    return rng.normal(0, 1.5, shape).astype(np.float32)


@pytest.mark.parametrize("cls, alias, zkind, ykind", CASES, ids=lambda v: str(v))
def test_value_and_gradient_equal_keras(cls, alias, zkind, ykind, rng):
    spec = LSP.fold(LSP.parse(alias), None)
    assert spec.name == cls and LSP.parse({"class_name": cls, "config": {}}).name == cls
    z, y = values(zkind, rng), values(ykind, rng)
    zt = tf.Variable(z)
    with tf.GradientTape() as tape:
        value = getattr(keras.losses, cls)()(y, zt)
    want, want_grad = float(value), tape.gradient(value, zt).numpy()
    loss = LS.Loss(spec, B, K)
    np.copyto(loss.labels, y)
    before = {id(v) for v in vars(loss.fn_work).values()}
    got = loss.step(z)
    assert {id(v) for v in vars(loss.fn_work).values()} == before
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(loss.grad, want_grad, rtol=1e-4, atol=1e-6)
    assert loss.total(z, y) / B == pytest.approx(want, rel=1e-5, abs=1e-6)
    _, work = LS.buffer_bytes(spec, B, K)
    assert work >= loss_fns.nbytes(B, K)


def test_unsupported_loss_arguments_are_refused_by_name():
    with pytest.raises(Exception, match=r"compile_config.loss.config.axis=0"):
        LSP.parse({"class_name": "CosineSimilarity", "config": {"axis": 0}})
    with pytest.raises(Exception, match=r"compile_config.loss='binary_focal_crossentropy'"):
        LSP.parse("binary_focal_crossentropy")


@pytest.mark.parametrize(
    "loss, act, ykind",
    [
        ("poisson", "softplus", "counts"),
        ("log_cosh", "linear", "float"),
        ("kl_divergence", "softmax", "probs"),
        ("squared_hinge", "tanh", "signs"),
        ("cosine_similarity", "linear", "float"),
    ],
)
def test_ten_sgd_steps_equal_keras_train_on_batch(loss, act, ykind, tmp_path, rng):
    keras.utils.set_random_seed(5)
    km = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3, act)]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    path = tmp_path / "m.keras"
    km.save(path)
    assert zipfile.is_zipfile(path)
    spec = KM.load(str(path))
    assert spec.config.loss.name == LSP.parse(loss).name
    flat = spec.init(0)
    views, grads = spec.views(flat), np.zeros_like(flat)
    gviews = spec.views(grads)
    prog = Program(spec, 8, train=True)
    ours, theirs = [], []
    for _ in range(10):
        x = rng.normal(0, 1, (8, 5)).astype(np.float32)
        y = values(ykind, rng, (8, 3))
        np.copyto(prog.x, x)
        np.copyto(prog.labels, y)
        ours.append(prog.loss_and_dlogits(prog.forward(views)))
        for _ in prog.backward_pieces(views, gviews):
            pass
        flat -= np.float32(0.05) * grads
        theirs.append(float(km.train_on_batch(x, y, return_dict=True)["loss"]))
    np.testing.assert_allclose(ours, theirs, rtol=3e-4, atol=1e-6)
