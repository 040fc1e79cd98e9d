"""Keras weight constraints (MaxNorm, NonNeg, UnitNorm, MinMaxNorm): a model built and
trained by real Keras and by ringtrain from the same ``.keras`` file on the same batches ends
with the same weights and losses; the export keeps the constraints; a tensor updated in slices
is projected once, after its last slice."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import follows_keras, train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.export import write_keras
from ringtrain_trainer.keras.load import load
from ringtrain_trainer.optim import constraints as C
from ringtrain_trainer.optim.sgd import SGD

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L, K = keras.layers, keras.constraints
STEPS, BATCH = 5, 8


def _model() -> keras.Model:
    m = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            L.Conv2D(3, 3, kernel_constraint=K.UnitNorm(axis=[0, 1, 2])),
            L.Flatten(),
            L.Dense(6, "relu", kernel_constraint=K.MaxNorm(0.4), bias_constraint="non_neg"),
            L.Dense(3, "softmax", kernel_constraint=K.MinMaxNorm(0.2, 0.6, rate=0.5, axis=0)),
        ]
    )
    m.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy")
    return m


def test_constrained_weights_train_like_keras_and_export(tmp_path, rng):
    km = _model()
    x = rng.normal(size=(40, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, STEPS, BATCH, n_train=32)
    try:
        line = t.training_line()
        assert "4 weight tensors projected (MaxNorm, MinMaxNorm, NonNeg, UnitNorm)" in line
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    follows_keras(ours, theirs, weights, km, rtol=1e-5, atol=1e-6)
    dense = weights[2]
    assert np.linalg.norm(dense, axis=0).max() <= 0.4 + 1e-6  # MaxNorm binds from step 1
    np.testing.assert_allclose(np.linalg.norm(weights[0].reshape(-1, 3), axis=0), 1, rtol=1e-5)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    got = {type(c).__name__ for layer in back.layers for c in _constraints(layer)}
    assert got == {"UnitNorm", "MaxNorm", "NonNeg", "MinMaxNorm"}


def _constraints(layer):
    names = ("kernel_constraint", "bias_constraint")
    return [c for c in (getattr(layer, n, None) for n in names) if c]


def test_a_tensor_updated_in_slices_is_projected_once_after_its_last_slice(rng):
    """MaxNorm's norms are per column: projecting each slice alone would differ."""
    w0 = rng.normal(size=(6, 4)).astype(np.float32) * 3
    g = rng.normal(size=w0.size).astype(np.float32)
    c = C.Constraint("MaxNorm", {"max_value": 1.0, "axis": 0}, (6, 4))
    results = []
    for cuts in ([0, 24], [0, 5, 13, 24]):
        opt = SGD(w0.reshape(-1).copy(), 0.1)
        opt.set_constraints([(0, 24, c)])
        opt.begin_step(0)
        for a, b in itertools.pairwise(cuts):
            opt.apply(g, a, b)
            norms = np.linalg.norm(opt.params.reshape(6, 4), axis=0)
            assert (b == 24) == np.allclose(norms, 1, rtol=1e-6), (cuts, b, norms)
        results.append(opt.params.copy())
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(np.linalg.norm(results[0].reshape(6, 4), axis=0), 1, rtol=1e-6)


def test_an_unknown_constraint_is_refused_by_name(tmp_path):
    class Clip(K.Constraint):
        def __call__(self, w):
            return keras.ops.clip(w, -1, 1)

    m = keras.Sequential([L.Input((4,)), L.Dense(2, kernel_constraint=Clip())])
    m.save(tmp_path / "m.keras")
    with pytest.raises(InvalidSpec, match=r"kernel_constraint=.* is not supported"):
        load(str(tmp_path / "m.keras"))
