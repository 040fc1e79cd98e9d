"""What ``keras.applications`` models are built from, against real Keras: ``Normalization``
(adapted weights and config constants), arithmetic on Keras tensors (MobileNetV3's
``ReLU(6)(x + 3) * (1 / 6)``), squeeze-and-excitation (``GlobalAveragePooling2D(keepdims)``
times the feature map, broadcast), ``Dropout(noise_shape)`` / ``SpatialDropout``; then whole
applications models (shrunk: 32×32 inputs, few channels) trained by ringtrain and by Keras from
the same ``.keras`` weights on the same batches.

Imports TensorFlow (slow), so one module holds these comparisons.
"""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort
from support.keras_steps import train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.broadcast import Broadcast
from ringtrain_trainer.engine.ops.dropout import SharedDropout
from ringtrain_trainer.engine.ops.standardize import Standardize
from ringtrain_trainer.export import read_keras, write_keras, write_onnx
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _blocks(rng):
    """Every new building block in one small Functional model (no dropout: Keras' masks
    cannot be reproduced, so dropout is checked on its own below)."""
    inp = L.Input((6, 6, 3))
    norm = L.Normalization()
    norm.adapt(rng.normal(2.0, 3.0, (20, 6, 6, 3)).astype(np.float32))
    h = norm(inp)
    h = L.Normalization(mean=[0.5, -0.5, 0.0], variance=[4.0, 1.0, 0.25])(h)
    h = L.Conv2D(4, 3, padding="same")(h)
    h = h * (L.ReLU(6.0)(h + 3.0) * (1.0 / 6.0))  # hard-swish, as MobileNetV3 writes it
    se = L.GlobalAveragePooling2D(keepdims=True)(h)
    se = L.Conv2D(4, 1, activation="sigmoid")(se)
    h = L.Multiply()([h, se])  # (6, 6, 4) × (1, 1, 4)
    h = (h - 1.0) / 2.0
    h = 0.5 - h
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inp, L.Dense(3, activation="softmax")(h))


def _train_like_keras(km, x, y, tmp_path, steps, batch, lr):
    """ringtrain (1 worker) and Keras from one ``.keras`` file on the same batches: both
    losses per step, and the trainer (the caller closes it)."""
    km.compile(optimizer=keras.optimizers.SGD(lr), loss="sparse_categorical_crossentropy")
    return train_beside_keras(km, x, y, tmp_path, steps, batch)


def _predict(t, x):
    prog = M.Program(t.spec, len(x), False, state=t.ipu.state)
    prog.x[:] = x.reshape(prog.x.shape)
    z = prog.forward(t.spec.views(t.params)).astype(np.float64)
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_application_building_blocks_train_like_keras_and_export(tmp_path, rng):
    km = _blocks(rng)
    x = rng.normal(1.0, 2.0, (32, 6, 6, 3)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    ours, theirs, t = _train_like_keras(km, x, y, tmp_path, steps=4, batch=8, lr=0.1)
    try:
        kinds = {type(op) for op in t.spec.layers}
        assert {Standardize, Broadcast} <= kinds
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
        want = km.predict(x[24:], verbose=0)
        np.testing.assert_allclose(_predict(t, x[24:]), want, atol=2e-6)
        config = t.spec.keras_config()
        weights = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    classes = [layer["class_name"] for layer in config["config"]["layers"]]
    assert classes.count("Rescaling") == 5 and classes.count("Multiply") == 2, classes
    path = write_keras(tmp_path / "out.keras", config, weights)
    back = keras.saving.load_model(path)
    np.testing.assert_allclose(back.predict(x[24:], verbose=0), want, atol=2e-6)
    count = next(w for w in back.weights if w.path.endswith("normalization/count"))
    theirs = next(w for w in km.weights if w.path.endswith("normalization/count"))
    assert count.dtype == "int64" and int(count.numpy()) == int(theirs.numpy())
    _, got = read_keras(path)
    for a, b in zip(got, weights, strict=True):
        np.testing.assert_array_equal(a, b)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x[24:]})[0], want, atol=2e-6)


def test_normalization_divides_by_at_least_keras_epsilon(rng):
    from support.opcheck import forward

    x = rng.normal(size=(2, 3)).astype(np.float32)
    stats = ([1.0, 0.0, -1.0], [0.0, 1e-20, 2.0])
    ours = forward(Standardize((3,), *stats), x, {}, dtype=np.float32)
    theirs = L.Normalization(mean=stats[0], variance=stats[1])(x)
    np.testing.assert_allclose(ours, np.asarray(theirs), rtol=1e-6)


def test_shared_dropout_masks_are_constant_along_the_noise_shape_and_split_by_example():
    from support.opcheck import compile_op

    op = SharedDropout((4, 4, 8), 0.5, 3, (1, 1, 8))
    ws = compile_op(op, 6, dtype=np.float32)
    out = np.array(op.forward(ws, np.ones((6, 4, 4, 8), np.float32)))
    assert set(np.unique(out)) <= {0.0, 2.0} and 0 < out.mean() < 2
    assert (out == out[:, :1, :1, :]).all()  # one value per example and channel
    half = compile_op(op, 3, dtype=np.float32)  # a second worker's examples 3..5
    half["ctx"] = {**ws["ctx"], "example0": ws["ctx"]["example0"] + 3}
    np.testing.assert_array_equal(op.forward(half, np.ones((3, 4, 4, 8), np.float32)), out[3:])


@pytest.mark.parametrize(
    "layer,noise",
    [
        (lambda: L.Dropout(0.3, noise_shape=(None, 1, 1, 1)), (1, 1, 1)),
        (lambda: L.SpatialDropout2D(0.3), (1, 1, 3)),
    ],
)
def test_dropout_with_a_noise_shape_builds_a_shared_mask_and_exports(layer, noise, tmp_path):
    inp = L.Input((4, 4, 3))
    km = keras.Model(inp, L.Dense(2)(L.Flatten()(layer()(inp))))
    from ringtrain_trainer.keras import load as KM

    spec = KM.from_config(json.loads(km.to_json()))
    (drop,) = [op for op in spec.layers if isinstance(op, SharedDropout)]
    assert drop.noise == noise
    path = write_keras(tmp_path / "d.keras", spec.keras_config(), km.get_weights())
    x = np.ones((2, 4, 4, 3), np.float32)
    np.testing.assert_allclose(
        keras.saving.load_model(path).predict(x, verbose=0), km.predict(x, verbose=0)
    )


def test_a_depthwise_initializer_sets_the_depthwise_kernel():
    from ringtrain_trainer.keras import load as KM

    init = keras.initializers.VarianceScaling(2.0, "fan_out", "truncated_normal")
    inp = L.Input((5, 5, 3))
    h = L.DepthwiseConv2D(3, depthwise_initializer=init)(inp)
    spec = KM.from_config(json.loads(keras.Model(inp, L.Flatten()(h)).to_json()))
    (kernel,) = [s.spec for s in spec.slots if s.spec.name == "kernel"]
    assert kernel.init is not None and kernel.init.args["mode"] == "fan_out"


def test_unsupported_operations_on_keras_tensors_are_refused_by_name():
    inp = L.Input((4,))
    cfg = json.loads(keras.Model(inp, 2.0 / inp).to_json())
    with pytest.raises(
        InvalidSpec, match=r"operation 'true_divide\w*' .*TrueDivide\) is not supported"
    ):
        parse(cfg, compiled=False)
    cfg = json.loads(keras.Model(inp, keras.ops.exp(inp)).to_json())
    with pytest.raises(InvalidSpec, match=r"operation 'exp\w*' \(keras\.src\.ops\.numpy\.Exp\)"):
        parse(cfg, compiled=False)


def _efficientnet():
    from keras.src.applications.efficientnet import EfficientNet

    return EfficientNet(
        0.25, 0.2, 32, dropout_rate=0, drop_connect_rate=0, input_shape=(32, 32, 3),
        weights=None, classes=4,
    )  # fmt: skip


def _mobilenet_v3():
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, dropout_rate=0
    )


def _convnext():
    return keras.applications.ConvNeXtTiny(
        weights=None, include_top=True, input_shape=(32, 32, 3), classes=10
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "build", [_efficientnet, _mobilenet_v3, _convnext], ids=["efficientnet", "mnv3", "convnext"]
)
def test_applications_models_follow_keras_loss_curve(build, tmp_path, rng):
    """Shrunk ``keras.applications`` models (dropout off: Keras' masks cannot be reproduced),
    1 worker with the global batch (BatchNormalization couples the batch): the same loss at
    every step. lr 1e-3: these BatchNorm stacks at initialization amplify float32 rounding
    (MobileNetV2's gradients differ by up to 2.3 % between TensorFlow float32 and float64;
    README's decisions), so a large step would compare rounding, not ringtrain."""
    keras.utils.set_random_seed(3)
    km = build()
    x = rng.random((32, 32, 32, 3)).astype(np.float32) * 255
    y = rng.integers(0, 4, 32)
    ours, theirs, t = _train_like_keras(km, x, y, tmp_path, steps=3, batch=8, lr=1e-3)
    try:
        np.testing.assert_allclose(ours, theirs, rtol=1e-4)
        np.testing.assert_allclose(_predict(t, x[24:]), km.predict(x[24:], verbose=0), atol=1e-5)
    finally:
        t.close()
