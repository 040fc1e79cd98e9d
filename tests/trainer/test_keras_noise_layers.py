"""Keras' noise layers (GaussianNoise, GaussianDropout, AlphaDropout) and MultiHeadAttention's
attention dropout: the identity in predict and in the exports (ringtrain predicts what Keras
predicts from the same ``.keras``), and in training the noise of Keras' formula — the mean and
variance of many draws against the formula and against Keras' own layer called with
``training=True`` — a new draw each step, the same draws for any split of the batch over
workers (as ``Dropout``'s masks).

Imports TensorFlow (slow): one module holds these comparisons.
"""

import io
import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort
from support.keras_steps import logits, softmax

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.noise import Noise
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
N = 20000


def _draw(mode, amount, x, step=3, example0=0):
    op = Noise(x.shape[1:], mode, amount, 2)
    bufs = op.buffers(len(x), True, need_dx=True)
    ws = {k: np.zeros(s, np.float32) for k, (s, _) in bufs.items()}
    ws["ctx"] = {"seed": 11, "step": step, "example0": example0}
    return op.forward(ws, x).copy()


KERAS = {
    "gaussian_noise": lambda a: L.GaussianNoise(a, seed=1),
    "gaussian_dropout": lambda a: L.GaussianDropout(a, seed=1),
    "alpha_dropout": lambda a: L.AlphaDropout(a, seed=1),
}


@pytest.mark.parametrize(
    "mode, amount, want_var",
    [
        ("gaussian_noise", 0.3, lambda x: np.full_like(x, 0.09)),
        ("gaussian_dropout", 0.2, lambda x: x**2 * 0.25),
    ],
)
def test_gaussian_noise_has_the_mean_and_variance_of_keras_formula(mode, amount, want_var, rng):
    x = np.repeat(np.array([[0.5], [-2.0]], np.float32), N, axis=1)
    out = _draw(mode, amount, x)
    theirs = np.asarray(KERAS[mode](amount)(x, training=True))
    for got in (out, theirs):
        np.testing.assert_allclose(
            got.mean(1), x[:, 0], atol=4 * math.sqrt(want_var(x)[:, 0].max() / N)
        )
        np.testing.assert_allclose(got.var(1), want_var(x)[:, 0], rtol=0.05)


def test_alpha_dropout_keeps_the_mean_and_variance_of_a_selu_input(rng):
    rate = 0.3
    x = rng.normal(size=(2, N)).astype(np.float32)  # SELU's fixed point: mean 0, variance 1
    out = _draw("alpha_dropout", rate, x)
    theirs = np.asarray(KERAS["alpha_dropout"](rate)(x, training=True))
    alpha_p = -1.6732632423543772 * 1.0507009873554805
    a = ((1 - rate) * (1 + rate * alpha_p**2)) ** -0.5
    dropped = np.float32(a * alpha_p - a * alpha_p * rate)
    for got in (out, theirs):
        assert abs(got.mean()) < 0.03 and abs(got.var() - 1) < 0.05
        assert np.isclose(got, dropped, atol=1e-6).mean() == pytest.approx(rate, abs=0.015)


@pytest.mark.parametrize("mode", list(KERAS))
def test_noise_is_new_each_step_and_the_same_for_any_worker_split(mode, rng):
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    whole = _draw(mode, 0.4, x)
    halves = np.concatenate([_draw(mode, 0.4, x[:2]), _draw(mode, 0.4, x[2:], example0=2)])
    np.testing.assert_array_equal(whole, halves)
    assert not np.allclose(whole, x) and not np.allclose(whole, _draw(mode, 0.4, x, step=4))


def test_noise_is_off_in_evaluation():
    op = Noise((3,), "gaussian_noise", 1.0, 0)
    assert op.buffers(4, False, need_dx=False) == {}
    x = np.ones((4, 3), np.float32)
    assert op.forward({}, x) is x


def _model():
    return keras.Sequential(
        [
            L.Input((6,)),
            L.Dense(8, activation="selu"),
            L.GaussianNoise(0.2),
            L.AlphaDropout(0.1),
            L.Dense(8, activation="tanh"),
            L.GaussianDropout(0.3),
            L.Dense(3, activation="softmax"),
        ]
    )


def test_noise_models_predict_like_keras_train_and_export_the_identity(tmp_path, rng):
    km = _model()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    km.save(tmp_path / "m.keras")
    x = rng.random((48, 6)).astype(np.float32)
    y = (x[:, 0] * 3).astype(np.int64).clip(0, 2)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", "4", "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.1"]
    args += ["--ipu-host-threads", "1", "--json", "--checkpoint-dir", str(tmp_path / "ck")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    try:
        z = logits(t, x[32:])
        np.testing.assert_allclose(softmax(z), km.predict(x[32:], verbose=0), atol=2e-5)
        assert not np.allclose(logits(t, x[32:], training=True), z, atol=1e-3)
        before = t.params.copy()
        losses = [t.train_one_step()[0] for _ in range(4)]
        assert np.all(np.isfinite(losses)) and not np.array_equal(t.params, before)
        want = softmax(logits(t, x[32:]))
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    assert [type(layer).__name__ for layer in back.layers][1:3] == ["GaussianNoise", "AlphaDropout"]
    np.testing.assert_allclose(back.predict(x[32:], verbose=0), want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[32:]})[0], want, atol=2e-5)


def test_alpha_dropout_noise_shape_is_refused_by_name():
    layers = [L.Input((2, 3)), L.AlphaDropout(0.2, noise_shape=(None, 1, 3)), L.Flatten()]
    config = json.loads(keras.Sequential(layers).to_json())
    with pytest.raises(InvalidSpec, match=r"AlphaDropout.*noise_shape=\[None, 1, 3\]"):
        parse(config, compiled=False)


def test_attention_dropout_drops_probabilities_in_training_only(tmp_path, rng):
    """``MultiHeadAttention(dropout=0.5)``: predict equals Keras' (no dropout); in training the
    attention probabilities are dropped at the rate and the rest scaled by 1 / (1 - rate), a
    mask per example, so a batch split over workers draws the same masks."""
    inp = L.Input((6, 4))
    att = L.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5)(inp, inp)
    km = keras.Model(inp, L.Dense(3)(L.Flatten()(att)))
    km.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    km.save(tmp_path / "m.keras")
    spec = keras_model.load(str(tmp_path / "m.keras"))
    views = spec.views(spec.initial[0].astype(np.float32))
    x = rng.normal(size=(4, 6, 4)).astype(np.float32)

    def run(xs, train, example0=0):
        prog = M.Program(spec, len(xs), train, state=spec.init_state())
        prog.x[:] = xs
        prog.ctx.update(seed=5, step=1, example0=example0)
        return prog.forward(views).copy(), prog

    predicted, _ = run(x, False)
    np.testing.assert_allclose(predicted, km.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    trained, prog = run(x, True)
    keep = next(ws["keep"] for ws in prog.ws if "keep" in ws)
    assert set(np.unique(keep)) == {0.0, 2.0}
    assert (keep == 0).mean() == pytest.approx(0.5, abs=0.08)
    assert not np.allclose(trained, predicted)
    halves = np.concatenate([run(x[:2], True)[0], run(x[2:], True, example0=2)[0]])
    np.testing.assert_allclose(halves, trained, rtol=1e-6, atol=1e-7)
