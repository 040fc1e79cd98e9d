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
from keras.src.applications.convnext import LayerScale

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.groupconv import GroupConv
from ringtrain_trainer.engine.ops.pool import Pool
from ringtrain_trainer.engine.ops.scale import ChannelScale
from ringtrain_trainer.engine.ops.timedistributed import TimeDistributed
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.keras.load import from_config
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 3, 8


@pytest.mark.parametrize(
    "inner",
    [
        Dense((4,), 3, "tanh", True, fast=False),
        Conv((4, 4, 2), 3, (2, 2), (1, 1), "valid", 1, "relu", True),
        Pool((4, 4, 2), "max", (2, 2), (2, 2), "valid"),
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
        (L.TimeDistributed(L.Dense(2, activity_regularizer="l2")), "activity_regularizer"),
    ],
)
def test_time_distributed_refusals_name_the_layer_and_argument(layer, match):
    with pytest.raises(InvalidSpec, match=match):
        parse(_config(layer), compiled=False)


@pytest.mark.parametrize(
    "op",
    [
        ChannelScale((3, 4), [0.5, -1.0, 2.0, 0.0], [0.1, 0.0, -0.2, 3.0]),
        ChannelScale((2, 2, 3)),
    ],
    ids=["rescaling", "layer-scale"],
)
def test_channel_scale_gradients(op, rng):
    check_gradients(op, rng)


def _convnext_block():
    """A ConvNeXt block as keras.applications builds it (depthwise 7x7 → LayerNormalization
    → pointwise MLP → LayerScale → residual), smaller, after a per-channel Rescaling."""
    inp = keras.Input((6, 6, 3))
    x = L.Rescaling([0.5, 1.0, 2.0], [0.1, 0.0, -0.2])(inp)
    x = L.Conv2D(8, 2, strides=2)(x)
    y = L.DepthwiseConv2D(3, padding="same")(x)
    y = L.LayerNormalization(epsilon=1e-6)(y)
    y = L.Dense(16, activation="gelu")(y)
    y = L.Dense(8)(y)
    y = LayerScale(0.5, 8)(y)
    x = L.Add()([x, y])
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inp, L.Dense(4, activation="softmax")(x))


def test_convnext_block_with_layer_scale_trains_like_keras_and_exports(tmp_path, rng):
    km = _convnext_block()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


def test_layer_scale_starts_at_init_values_and_exports_its_module():
    km = keras.Sequential([L.Input((5,)), LayerScale(0.25, 5), L.Dense(2, use_bias=False)])
    spec = from_config(json.loads(km.to_json()))
    (gamma,) = [x for x in spec.slots if x.spec.name == "gamma"]
    np.testing.assert_array_equal(spec.init(3)[gamma.start : gamma.stop], np.full(5, 0.25))
    layer = spec.keras_config()["config"]["layers"][1]
    assert (layer["module"], layer["registered_name"]) == (LayerScale.__module__, "LayerScale")


@pytest.mark.parametrize(
    "layer,match",
    [
        (L.Rescaling([1.0, 2.0]), "scale has 2 values for 3 channels"),
        (L.Rescaling(1.0, offset="x"), "offset='x'"),
        (LayerScale(0.1, 3), "projection_dim=4"),
    ],
)
def test_scale_refusals(layer, match):
    config = _config(layer)
    if isinstance(layer, LayerScale):  # Keras itself would not build it: edit the config
        config["config"]["layers"][1]["config"]["projection_dim"] = 4
    with pytest.raises(InvalidSpec, match=match):
        parse(config, compiled=False)


@pytest.mark.parametrize(
    "op",
    [
        GroupConv((5, 5, 4), 6, (3, 3), (1, 1), "same", (1, 1), "tanh", True, 2),
        GroupConv((7, 6), 4, (3,), (2,), "valid", (1,), "linear", False, 2),
        GroupConv((4, 4, 6), 3, (1, 1), (1, 1), "valid", (1, 1), "relu", True, 3),
    ],
    ids=["2d-same", "1d-strided", "pointwise"],
)
def test_group_conv_gradients(op, rng):
    check_gradients(op, rng)


def _grouped():
    return keras.Sequential(
        [
            L.Input((12, 4)),
            L.Conv1D(6, 3, groups=2, padding="causal", activation="relu"),
            L.Conv1D(6, 3, groups=3, strides=2, padding="same", use_bias=False),
            L.Reshape((3, 2, 6)),
            L.Conv2D(4, 2, groups=2, padding="same", activation="gelu"),
            L.Conv2D(4, 3, groups=4, padding="same", kernel_initializer="he_normal"),
            L.Conv2D(8, (2, 1), groups=4, dilation_rate=(1, 1)),
            L.Flatten(),
            L.Dense(4, activation="softmax"),
        ]
    )


def test_grouped_convolutions_train_like_keras_and_export(tmp_path, rng):
    km = _grouped()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


def test_groups_that_do_not_divide_are_refused():
    config = _config(L.Conv1D(4, 2, groups=2), shape=(5, 4))
    config["config"]["layers"][1]["config"]["groups"] = 3
    with pytest.raises(InvalidSpec, match="groups=3 must divide"):
        parse(config, compiled=False)
