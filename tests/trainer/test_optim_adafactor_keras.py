"""Keras' ``Adafactor``: ringtrain and real Keras trained from one ``.keras`` file on the same
batches reach the same losses and weights — factored moments over each weight's last two axes
(a conv kernel, a dense kernel), a full one for a bias, ``relative_step``, a schedule, clipnorm —
with the reducer's pieces cutting tensors anywhere (each tensor is updated once it is whole)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import train_beside_keras

from ringtrain_trainer import optim
from ringtrain_trainer.optim.adafactor import Adafactor
from ringtrain_trainer.optim.clip import Clip

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 6, 8


def _model(optimizer) -> keras.Model:
    m = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            L.Conv2D(4, 3, activation="relu"),
            L.Flatten(),
            L.Dense(5, "tanh"),
            L.Dense(3, "softmax"),
        ]
    )
    m.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return m


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.Adafactor(0.05),
        lambda: keras.optimizers.Adafactor(
            keras.optimizers.schedules.ExponentialDecay(0.2, 2, 0.5),
            clip_threshold=0.5,
            clipnorm=0.3,
        ),
        lambda: keras.optimizers.Adafactor(
            0.03, relative_step=False, beta_2_decay=-0.5, epsilon_2=1e-2
        ),
    ],
    ids=["relative_step", "schedule_clipnorm", "absolute_step"],
)
def test_adafactor_trains_like_keras(optimizer, tmp_path, rng):
    km = _model(optimizer())
    x = rng.normal(size=(40, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    w0 = [w.copy() for w in km.get_weights()]
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, STEPS, BATCH, n_train=32)
    try:
        assert t.optimizer_spec.class_name == "Adafactor"
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    np.testing.assert_allclose(ours, theirs, rtol=2e-5)
    for a, b, c in zip(weights, km.get_weights(), w0, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
        assert np.abs(a - c).max() > 1e-5  # every tensor moved (a zero bias: by ~eps2 * lr)


def test_each_tensor_is_updated_once_whole_whatever_the_pieces(rng):
    """The same update whether the reduced gradient arrives whole or cut across tensors."""
    shapes = [(3, 4), (4,), (2, 2, 3)]
    ranges, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        ranges.append((at, at + n, s))
        at += n
    w0 = rng.normal(size=at).astype(np.float32)
    g = rng.normal(size=at).astype(np.float32)
    results = []
    for cuts in ([0, at], [0, 5, 13, 19, at]):
        opt = Adafactor(w0.copy(), optim.StepDecay(0.1, 1.0, 1))
        opt.set_clip(Clip(None, 0.0, [(a, b) for a, b, _ in ranges], whole=True))
        opt.set_shapes(ranges)
        for _ in range(3):
            opt.begin_step(0)
            for a, b in itertools.pairwise(cuts):
                opt.apply(g, a, b)
        results.append(opt.params.copy())
    np.testing.assert_array_equal(results[0], results[1])
    assert opt.state["factored"].size == (3 + 4) + 4 + (2 * 2 + 2 * 3)
