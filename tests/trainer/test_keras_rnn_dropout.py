"""Keras RNN ``dropout`` (without ``recurrent_dropout``): Keras 3 draws one mask per sequence
over the input features from the first step and applies it at every step, scaled by
``1 / (1 - rate)`` (``LSTM.call``); ringtrain runs it as a shared-mask Dropout node before the
RNN. Inference is the identity (predictions equal Keras'), training draws masks of that shape
and rate, a rate outside [0, 1) and dropout inside ``Bidirectional`` are refused by name
(``recurrent_dropout``: test_keras_recurrent_dropout)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import logits, softmax, train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.dropout import SharedDropout
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
RATE, T, F = 0.4, 7, 6


@pytest.mark.parametrize("rnn", [L.LSTM, L.GRU, L.SimpleRNN])
def test_rnn_input_dropout_masks_whole_sequences_in_training_only(rnn, tmp_path, rng):
    km = keras.Sequential([L.Input((T, F)), rnn(5, dropout=RATE), L.Dense(3, "softmax")])
    km.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(80, T, F)).astype(np.float32)
    y = rng.integers(0, 3, 80)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 2, 64, n_train=64)
    try:
        prog = t.exe.programs[0]
        (k,) = [i for i, op in enumerate(t.spec.layers) if isinstance(op, SharedDropout)]
        keep = prog.ws[k]["keep"]
        assert keep.shape == (64, 1, F)  # one mask per sequence, the same at every step
        assert np.all((keep == 0) | np.isclose(keep, 1 / (1 - RATE)))
        dropped = float(np.mean(keep == 0))
        assert abs(dropped - RATE) < 0.1, dropped
        rnn_in = prog.ws[k]["out"]
        inp = prog.x.reshape(64, T, F)
        np.testing.assert_allclose(rnn_in, inp * keep, rtol=1e-6)
        out = softmax(logits(t, x[64:]))
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    # the losses differ (other masks than Keras'), the losses are finite and near each other
    assert np.all(np.isfinite(ours)) and abs(ours[0] - theirs[0]) < 0.5
    km.set_weights(weights)  # inference: no dropout on either side
    want = km.predict(x[64:], verbose=0)
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize(
    "layer,match",
    [
        (L.LSTM(4, recurrent_dropout=1.0), r"recurrent_dropout=1\.0 is not supported"),
        (L.Bidirectional(L.GRU(4, dropout=0.2)), r"layer\.dropout=0\.2 is not supported"),
    ],
)
def test_rnn_dropouts_ringtrain_cannot_run_as_keras_are_refused_by_name(layer, match):
    config = json.loads(keras.Sequential([L.Input((T, F)), layer]).to_json())
    with pytest.raises(InvalidSpec, match=match):
        parse(config, compiled=False)
