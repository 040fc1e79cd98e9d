"""Keras-config models against real Keras (TensorFlow CPU): forward, gradients, .keras files.

The one test module that imports TensorFlow (slow to import): the same model is built in Keras
from ``KerasModel.keras_config()``, given the IPU's weights through ``keras_weights``, and must
agree with the IPU's forward pass (inference) and gradients (``tf.GradientTape``, training
mode: batch statistics, no dropout) within float32 rounding.
"""

import copy
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf
from test_keras_layers import NARROW, WIDE

from ringtrain_trainer.engine import model as M
from ringtrain_trainer.keras import load as KM
from ringtrain_trainer.keras import load as keras_load

pytestmark = [
    # TensorFlow's own tensors under numpy 2, when Keras saves weights
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword"),
    # NARROW really does give softmax outputs to a from_logits=True loss, as the config says
    pytest.mark.filterwarnings("ignore:.*received `from_logits=True`:UserWarning"),
]


def no_dropout(config):
    c = copy.deepcopy(config)
    for layer in c["config"]["layers"]:
        if layer["class_name"] == "Dropout":
            layer["config"]["rate"] = 0.0
    return c


def setup(config, rng, batch=6):
    spec = KM.from_config(config)
    flat = spec.init(1) + rng.normal(0, 0.05, spec.num_params).astype(np.float32)
    state = spec.init_state()
    state += rng.random(state.shape).astype(np.float32) * 0.5  # positive variances
    km = keras.models.model_from_json(json.dumps(spec.keras_config()))
    km.set_weights(spec.keras_weights(flat, state))
    x = rng.random((batch, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, spec.num_classes, batch)
    return spec, flat, state, km, x, y


def softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize(
    "config", [WIDE, NARROW, KM.preset_config("cnn2")], ids=["wide", "narrow", "cnn2"]
)
def test_forward_matches_keras_inference(config, rng):
    spec, flat, state, km, x, _ = setup(config, rng)
    prog = M.Program(spec, len(x), False, state=state)
    prog.x[:] = x
    out = prog.forward(spec.views(flat))
    if spec.config.ends_in_softmax:  # folded into the loss
        out = softmax(out)
    want = km(x.reshape((-1, *spec.config.input_shape)), training=False).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "config", [no_dropout(WIDE), NARROW, KM.preset_config("cnn")], ids=["wide", "narrow", "cnn"]
)
def test_loss_and_gradients_match_keras_training(config, rng):
    spec, flat, state, km, x, y = setup(config, rng)
    prog = M.Program(spec, len(x), True, state=state.copy())
    prog.x[:] = x
    prog.labels[:] = y
    views = spec.views(flat)
    loss = prog.loss_and_dlogits(prog.forward(views))
    grad = np.zeros_like(flat)
    for _ in prog.backward_pieces(views, spec.views(grad)):  # the production path, drained
        pass
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=spec.config.from_logits)
    with tf.GradientTape() as tape:
        want_loss = lossf(y, km(x.reshape((-1, *spec.config.input_shape)), training=True))
    want = tape.gradient(want_loss, km.trainable_weights)
    assert loss == pytest.approx(float(want_loss), rel=1e-5)
    mine = [
        g
        for (_, _, where, _), g in zip(
            spec._weight_refs(), spec.keras_weights(grad, state), strict=True
        )
        if where == "p"
    ]
    assert len(mine) == len(want)
    for a, b, w in zip(mine, want, km.trainable_weights, strict=True):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-3, atol=2e-6, err_msg=w.path)
    # the moving statistics moved like Keras' (batch mean and biased variance, momentum)
    np.testing.assert_allclose(
        prog.state, spec.from_keras_weights(km.get_weights())[1], rtol=1e-5, atol=1e-6
    )


def test_real_to_json_of_every_supported_layer_parses(tmp_path):
    L = keras.layers
    km = keras.Sequential(
        [
            L.InputLayer(shape=(12, 12)),
            L.Reshape((12, 12, 1)),
            L.Rescaling(1 / 255),
            L.Conv2D(4, 3, strides=2, padding="same", activation="tanh"),
            L.BatchNormalization(),
            L.AveragePooling2D(2, padding="same"),
            L.Conv2D(3, (2, 3), use_bias=False),
            L.ReLU(),
            L.MaxPooling2D(1),
            L.GlobalAveragePooling2D(),
            L.Dropout(0.3),
            L.Dense(5, activation="sigmoid"),
            L.Activation("tanh"),
            L.Dense(4),
            L.Softmax(),
        ]
    )
    km.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    spec = KM.from_config(json.loads(km.to_json()))
    assert not spec.config.from_logits and spec.num_classes == 4
    km.save(tmp_path / "m.keras")
    loaded = KM.load(str(tmp_path / "m.keras"))
    flat, state = loaded.initial
    for a, b in zip(loaded.keras_weights(flat, state), km.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_keras_file_is_the_starting_point_and_its_predictions_carry_over(tmp_path, rng):
    _spec, flat, state, km, x, _ = setup(WIDE, rng)
    km.save(tmp_path / "wide.keras")
    loaded = KM.load(str(tmp_path / "wide.keras"))
    np.testing.assert_array_equal(loaded.init(0), flat)
    np.testing.assert_array_equal(loaded.init_state(), state)
    prog = M.Program(loaded, len(x), False)
    prog.x[:] = x
    want = km.predict(x, verbose=0)
    np.testing.assert_allclose(
        softmax(prog.forward(loaded.views(loaded.init(0)))), want, rtol=1e-4, atol=1e-5
    )


def test_presets_are_keras_configs_keras_itself_loads():
    for name in KM.PRESETS:
        km = keras.models.model_from_json(json.dumps(KM.preset_config(name)))
        spec = keras_load.build(name)
        assert km.count_params() == spec.num_params
        assert [w.shape for w in km.get_weights()] == [
            w.shape for w in spec.keras_weights(spec.init(0))
        ]


def test_a_rescaling_model_on_uint8_npz_sees_what_keras_fit_feeds_it(tmp_path, rng):
    """``Rescaling(1/255)`` first and uint8 pixels in a ``.npz``: ringtrain once scaled them in
    the loader too (0.62 against Keras' 0.82; its export 0.32 on raw pixels). Training,
    the worker's and the evaluator's evaluation, and the exported model must all see what
    Keras' ``fit``/``model(x)`` see: the raw uint8 batch, scaled once by the model."""
    import io

    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.evaluator import Evaluator, cross_entropy
    from ringtrain_trainer.worker import Trainer

    L = keras.layers
    km = keras.Sequential(
        [
            L.InputLayer(shape=(8, 8, 1)),
            L.Rescaling(1 / 255),
            L.Conv2D(3, 3, activation="relu"),
            L.Flatten(),
            L.Dense(4),
        ]
    )
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss=lossf)
    km.save(tmp_path / "m.keras")
    x = rng.integers(0, 256, (48, 8, 8, 1)).astype(np.uint8)
    y = rng.integers(0, 4, 48)
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    x_test, y_test = x[32:], y[32:]
    common = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    common += ["--checkpoint-dir", str(tmp_path / "ck")]
    cfg = TrainerConfig.from_args(
        [
            *common,
            "--steps",
            "6",
            "--batch-size",
            "8",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
            "--ipu-host-threads",
            "1",
            "--export",
            str(tmp_path / "out.keras"),
            "--json",
        ],
        {},
    )
    t = Trainer(cfg, LocalCollective(), out=io.StringIO())
    try:
        # the same weights, the same raw batch: the same outputs as Keras' model(x)
        prog = M.Program(t.spec, len(x_test), False)
        prog.x[:] = t.data.test.inputs()
        want = km(x_test, training=False).numpy()
        np.testing.assert_allclose(prog.forward(t.spec.views(t.params)), want, rtol=1e-4, atol=1e-5)
        # six SGD steps on the same batches: the same losses as Keras' train_on_batch
        for _ in range(6):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            assert loss == pytest.approx(float(km.train_on_batch(x[idx], y[idx])), rel=1e-4)
        want = km.predict(x_test, verbose=0)
        keras_acc = float(np.mean(want.argmax(1) == y_test))
        keras_loss = float(lossf(y_test, want))
        assert t.evaluate() == keras_acc
        t.save(loss)
        exported = keras.saving.load_model(t.export(loss), compile=False).predict(x_test, verbose=0)
    finally:
        t.close()
    np.testing.assert_allclose(exported, want, rtol=1e-3, atol=1e-4)  # raw pixels in
    ev = Evaluator(
        TrainerConfig.from_args(common, {"TF_CONFIG": '{"task":{"type":"evaluator"}}'}),
        out=io.StringIO(),
    )
    state = ev.ckpt.load(ev.ckpt.manifests()[-1])
    assert ev.evaluate(state) == pytest.approx((keras_loss, keras_acc), rel=1e-4)
    assert cross_entropy(exported, y_test) / len(y_test) == pytest.approx(keras_loss, rel=1e-4)


def test_a_layer_keras_froze_is_held_frozen_not_trained(tmp_path):
    """``layer.trainable = False`` (fine-tuning) is in Keras' own JSON; ringtrain once trained
    the frozen weights anyway. Now they are state (tests/trainer/test_keras_nested.py trains
    such models against Keras)."""
    L = keras.layers
    km = keras.Sequential([L.InputLayer(shape=(4,)), L.Dense(3, name="frozen"), L.Dense(2)])
    km.layers[0].trainable = False
    km.save(tmp_path / "m.keras")
    spec = KM.load(str(tmp_path / "m.keras"))
    assert (spec.num_params, spec.num_frozen) == (3 * 2 + 2, 4 * 3 + 3)
