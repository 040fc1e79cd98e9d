"""Keras models built from the window and shape layers (Conv1D, a dilated Conv2D,
Depthwise/SeparableConv 1-D and 2-D, 1-D pooling, global max/average pooling, zero padding,
cropping, up-sampling) and from activations beyond relu, as arguments and as layers
(ReLU(6.), LeakyReLU, ELU, Activation("gelu"), Dense(gelu)), trained by ringtrain and by Keras
from the same ``.keras`` starting weights on the same batches: the same loss at every step,
the same predictions after, and exports that Keras and onnxruntime load and that predict what
ringtrain predicts.

Imports TensorFlow (slow): one module holds these comparisons.
"""

import io
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops import activations
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras import onnx_acts
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 3, 8


def _sequence():
    return keras.Sequential(
        [
            L.Input((16, 3)),
            L.Conv1D(6, 3, padding="causal", dilation_rate=2, activation="gelu"),
            L.MaxPooling1D(2, padding="same"),
            L.LeakyReLU(0.1),
            L.ZeroPadding1D((1, 2)),
            L.SeparableConv1D(5, 3, strides=2, padding="same", activation="swish"),
            L.DepthwiseConv1D(3, depth_multiplier=2, padding="same", activation="elu"),
            L.Cropping1D((1, 0)),
            L.ReLU(negative_slope=0.1, threshold=0.05),
            L.ELU(0.5),
            L.UpSampling1D(2),
            L.AveragePooling1D(3, strides=2, padding="same"),
            L.Conv1D(4, 2, kernel_initializer="he_normal", activation="mish"),
            L.GlobalAveragePooling1D(),
            L.Dense(8, activation="gelu"),
            L.Dense(4, activation="softmax"),
        ]
    )


def _mobile():
    return keras.Sequential(
        [
            L.Input((8, 8, 2)),
            L.ZeroPadding2D(1),
            L.DepthwiseConv2D(3, depth_multiplier=2),
            L.ReLU(6.0),
            L.SeparableConv2D(6, 3, padding="same", dilation_rate=2, activation="hard_swish"),
            L.Cropping2D(((1, 0), (0, 1))),
            L.UpSampling2D(2),
            L.Conv2D(4, 3, padding="same", dilation_rate=2, activation="gelu"),
            L.DepthwiseConv2D(3, strides=2, padding="same", activation="selu"),
            L.Activation("gelu"),
            L.GlobalMaxPooling2D(),
            L.Dense(4, activation="softmax"),
        ]
    )


MODELS = {"sequence": _sequence, "mobile": _mobile}


def test_the_onnx_activation_names_are_the_engine_table():
    engine = {*activations.ACTIVATIONS, *activations.ALIASES} - {"gelu_tanh"}
    assert set(onnx_acts.NAMES) == engine


@pytest.mark.parametrize("name", list(MODELS))
def test_window_models_train_like_keras_and_export_what_they_predict(name, tmp_path, rng):
    km = MODELS[name]()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
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
        logits = prog.forward(t.spec.views(t.params)).copy()
        want = km.predict(x[32:], verbose=0)
        mine = np.exp(logits - logits.max(1, keepdims=True))
        np.testing.assert_allclose(mine / mine.sum(1, keepdims=True), want, atol=2e-5)
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    path = write_keras(tmp_path / "out.keras", config, weights)
    back = keras.saving.load_model(path).predict(x[32:], verbose=0)
    np.testing.assert_allclose(back, want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (onnx_out,) = sess.run(None, {"input": x[32:]})
    np.testing.assert_allclose(onnx_out, want, atol=2e-5)
