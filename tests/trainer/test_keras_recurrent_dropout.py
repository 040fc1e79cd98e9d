"""Keras RNN ``recurrent_dropout``: Keras 3 forces ``implementation=1`` and draws, per
example and once per sequence, a state mask per gate (LSTM four, GRU three, SimpleRNN one)
and, with ``dropout``, an input mask per gate too; training only. Checked here: the training
forward equals Keras' own cell stepped with the very masks ringtrain drew (per gate, per
example, the same at every step), gradients against finite differences with those masks
fixed, the LSTM's fused path off, a fresh draw per step, and Keras-side training, prediction
and the ``.keras`` and ONNX exports; inside ``Bidirectional`` it stays refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.gradcheck import gradcheck
from support.keras_steps import logits, softmax, train_beside_keras
from support.ophost import backward, compile_op

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.recurrent import GRU, LSTM, SimpleRNN
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
B, T, F, U = 4, 5, 3, 4
OPS = {"LSTM": LSTM, "GRU": GRU, "SimpleRNN": SimpleRNN}
CELLS = {"LSTM": L.LSTMCell, "GRU": L.GRUCell, "SimpleRNN": L.SimpleRNNCell}


def _op(cls, drop=0.3, rdrop=0.4, **kw):
    kw.setdefault("return_sequences", True)
    return OPS[cls]((T, F), U, dropout=drop, recurrent_dropout=rdrop, index=3, **kw)


@pytest.mark.parametrize("cls", list(OPS))
def test_training_forward_is_keras_cell_with_the_same_masks(cls, rng):
    op = _op(cls)
    assert not op.fast
    ws = compile_op(op, B, np.float32)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    params = {p.name: rng.normal(0, 0.5, p.shape).astype(np.float32) for p in op.params(0)}
    out = op.forward(ws, x, **params).copy()
    rmask = ws["rmask"].copy()
    k = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}[cls]
    assert rmask.shape == (B, k, U)
    assert np.all(np.isclose(rmask, 0) | np.isclose(rmask, 1 / 0.6))
    assert len({rmask[:, g].tobytes() for g in range(k)}) == k  # a mask per gate
    cell = CELLS[cls](U, dropout=0.3, recurrent_dropout=0.4)
    cell.build((B, F))
    cell.set_weights([params[p.name] for p in op.params(0)])
    if cls == "SimpleRNN":  # one input mask: the SharedDropout node before the op draws it
        assert "imask" not in ws
        cell.dropout = 0.0
        cell._recurrent_dropout_mask = rmask[:, 0]
    else:
        cell._dropout_mask = [ws["imask"][:, g] for g in range(k)]
        cell._recurrent_dropout_mask = [rmask[:, g] for g in range(k)]
    states = [np.zeros((B, U), np.float32)] * (2 if cls == "LSTM" else 1)
    for t in range(T):  # Keras reuses its cached masks at every step
        y, states = cell(x[:, t], states, training=True)
        states = states if isinstance(states, list | tuple) else [states]
        np.testing.assert_allclose(out[:, t], np.asarray(y), atol=2e-5, err_msg=f"step {t}")
    ws["ctx"]["step"] += 1  # the next step draws other masks
    op.forward(ws, x, **params)
    assert not np.array_equal(ws["rmask"], rmask)


CASES = {
    "lstm": _op("LSTM"),
    "lstm-backwards-last": _op("LSTM", return_sequences=False, go_backwards=True),
    "gru": _op("GRU"),
    "gru-no-input-dropout": _op("GRU", drop=0.0),
    "simple-rnn": _op("SimpleRNN"),
    "lstm-keras-mask": _op("LSTM", masked=True, zero_output_for_mask=True),
}
#: a Keras mask for the masked case: right padding, left padding, a hole
MASK = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], float)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_with_fixed_masks_match_finite_differences(case, rng):
    op = CASES[case]
    ws = compile_op(op, B)  # a fixed ctx: every forward draws the same masks
    x = rng.normal(size=(B, T, F))
    params = {p.name: rng.normal(0, 0.5, p.shape) for p in op.params(0)}
    w = rng.normal(size=(B, *op.out_shape))
    xs = [x, MASK] if op.masked else [x]

    def loss():
        return float(np.sum(op.forward(ws, *xs, **params) * w))

    loss()
    assert np.any(ws["rmask"] == 0)
    (dx, *_), grads = backward(op, ws, xs, params, w.copy())
    gradcheck(loss, x, dx, what=f"{case} input")
    for name, g in grads.items():
        gradcheck(loss, params[name], g, rng=rng, samples=25, what=f"{case} {name}")


@pytest.mark.parametrize("rnn", [L.LSTM, L.GRU, L.SimpleRNN])
def test_recurrent_dropout_trains_beside_keras_and_predicts_and_exports(rnn, tmp_path, rng):
    km = keras.Sequential(
        [L.Input((T, F)), rnn(5, dropout=0.2, recurrent_dropout=0.3), L.Dense(3, "softmax")]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    x = rng.normal(size=(40, T, F)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 2, 16, n_train=32)
    try:
        out = softmax(logits(t, x[32:]))
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    # other masks than Keras': the losses are finite and near each other
    assert np.all(np.isfinite(ours)) and abs(ours[0] - theirs[0]) < 0.5
    km.set_weights(weights)  # inference: no dropout on either side
    want = km.predict(x[32:], verbose=0)
    np.testing.assert_allclose(out, want, atol=2e-5)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert back.layers[0].recurrent_dropout == pytest.approx(0.3)
    np.testing.assert_allclose(back.predict(x[32:], verbose=0), want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)  # dropout is training only: none in ONNX
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input": x[32:]})
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_recurrent_dropout_inside_bidirectional_is_refused_by_name():
    layer = L.Bidirectional(L.LSTM(4, recurrent_dropout=0.2))
    config = json.loads(keras.Sequential([L.Input((T, F)), layer]).to_json())
    with pytest.raises(InvalidSpec, match=r"layer\.recurrent_dropout=0\.2 is not supported"):
        parse(config, compiled=False)
