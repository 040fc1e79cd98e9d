"""Keras ``TimeDistributed`` (and the layers of issue 19 that follow it): the op through the
shared finite-difference check (``support.opcheck``), models trained by ringtrain and by Keras
from the same ``.keras`` start weights on the same batches (the loss at every step within
1e-4 relative, predictions after within 2e-5), their exports reloaded by Keras and by
onnxruntime, and the refusals of what Keras would compute differently.

Imports TensorFlow (slow): one module holds these comparisons.
"""

import io
import json
import os

import numpy as np
import pytest
from support.opcheck import check_gradients, forward

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import layers as RL
from ringtrain_trainer import model as M
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.ops.timedistributed import TimeDistributed
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 3, 8


@pytest.mark.parametrize(
    "inner",
    [
        RL.Linear(4, 3, "tanh", True),
        RL.Conv2D((4, 4, 2), 3, (2, 2), (1, 1), "valid", "relu", True),
        RL.Pool2D((4, 4, 2), "max", (2, 2), (2, 2), "valid"),
    ],
    ids=["dense", "conv", "pool"],
)
def test_time_distributed_op_gradients_and_forward(inner, rng):
    in_shape = (inner.n_in,) if hasattr(inner, "n_in") else inner.in_shape
    op = TimeDistributed(inner, 3, in_shape, inner.out_shape)
    check_gradients(op, rng)
    x = rng.normal(size=(2, *op.in_shape))
    params = {p.name: rng.normal(size=p.shape) for p in op.params(0)}
    steps = [forward(inner, x[:, t], params) for t in range(3)]
    np.testing.assert_allclose(forward(op, x, params), np.stack(steps, 1), rtol=1e-12)


def _video():
    return keras.Sequential(
        [
            L.Input((4, 6, 6, 2)),
            L.TimeDistributed(L.Conv2D(3, 3, activation="relu", kernel_regularizer="l2")),
            L.TimeDistributed(L.MaxPooling2D()),
            L.TimeDistributed(L.Flatten()),
            L.TimeDistributed(L.Dense(5, activation="tanh")),
            L.GRU(6),
            L.Dense(4, activation="softmax"),
        ]
    )


def _tagger():
    """Per-step classification: the softmax of the wrapped Dense is folded into the loss."""
    return keras.Sequential(
        [
            L.Input((5, 3)),
            L.TimeDistributed(L.Dense(6, activation="relu")),
            L.LSTM(4, return_sequences=True),
            L.TimeDistributed(L.Dense(4, activation="softmax")),
            L.Flatten(),
            L.Dense(4, activation="softmax"),
        ]
    )


MODELS = {"video": _video, "tagger": _tagger}


def train_like_keras(km, tmp_path, rng):
    """Train ``km`` (compiled) in ringtrain and in Keras on the same batches; returns the
    test inputs, Keras' predictions after, and ringtrain's exported config and weights."""
    km.save(tmp_path / "m.keras")
    shape = km.input_shape[1:]
    x = rng.random((48, *shape)).astype(np.float32)
    y = rng.integers(0, 4, 48)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--optimizer", "sgd"]
    args += ["--lr", "0.1", "--ipu-host-threads", "1", "--json"]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    try:
        for _ in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            assert loss == pytest.approx(float(km.train_on_batch(x[idx], y[idx])), rel=1e-4)
        prog = M.Program(t.spec, 16, False, state=t.ipu.state)
        prog.x[:] = x[32:].reshape(prog.x.shape)
        out = prog.forward(t.spec.views(t.params)).copy()
        want = km.predict(x[32:], verbose=0)
        if t.spec.config.ends_in_softmax:
            out = np.exp(out - out.max(1, keepdims=True))
            out /= out.sum(1, keepdims=True)
        np.testing.assert_allclose(out, want, atol=2e-5)
        return x[32:], want, t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()


def check_exports(x, want, config, weights, tmp_path, onnx=True):
    path = write_keras(tmp_path / "out.keras", config, weights)
    back = keras.saving.load_model(path).predict(x, verbose=0)
    np.testing.assert_allclose(back, want, atol=2e-5)
    if onnx:
        write_onnx(tmp_path / "m.onnx", config, weights)
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        (onnx_out,) = sess.run(None, {"input": x})
        np.testing.assert_allclose(onnx_out, want, atol=2e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_time_distributed_models_train_like_keras_and_export(name, tmp_path, rng):
    km = MODELS[name]()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


def _config(*layers, shape=(4, 3)):
    return json.loads(keras.Sequential([L.Input(shape), *layers]).to_json())


@pytest.mark.parametrize(
    "layer,match",
    [
        (L.TimeDistributed(L.BatchNormalization()), "layer='BatchNormalization'"),
        (L.TimeDistributed(L.Dropout(0.5)), "layer='Dropout'"),
        (L.TimeDistributed(L.Dense(2, kernel_constraint="non_neg")), "kernel_constraint"),
    ],
)
def test_time_distributed_refusals_name_the_layer_and_argument(layer, match):
    with pytest.raises(InvalidSpec, match=match):
        parse(_config(layer), compiled=False)
