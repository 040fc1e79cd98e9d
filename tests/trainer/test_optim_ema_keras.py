"""Keras' ``use_ema`` (``ema_momentum``, ``ema_overwrite_frequency``): ringtrain and real Keras
trained from one ``.keras`` file on the same batches keep the same weights and the same moving
average at every step, and at the end of training the weights become the average, as
``fit`` makes them (``finalize_variable_values``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.keras_steps import train_beside_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import optim
from ringtrain_trainer.optim.sgd import SGD

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH = 5, 8


def _model(optimizer) -> keras.Model:
    m = keras.Sequential(
        [
            L.Input((5,)),
            L.Dense(7, "tanh", kernel_constraint=keras.constraints.MaxNorm(0.8)),
            L.Dense(3, "softmax"),
        ]
    )
    m.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return m


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.3, momentum=0.9, use_ema=True, ema_momentum=0.8),
        lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=2),
    ],
    ids=["sgd_ema", "adam_ema_overwrite_every_2"],
)
def test_the_moving_average_follows_keras_and_becomes_the_weights_at_the_end(
    optimizer, tmp_path, rng
):
    km = _model(optimizer())
    x = rng.normal(size=(48, 5)).astype(np.float32)
    y = rng.integers(0, 3, 48)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, STEPS, BATCH, n_train=40)
    try:
        assert "use_ema=True" in t.optimizer_spec.describe()
        raw = t.spec.keras_weights(t.params, t.ipu.state)
        average = t.spec.keras_weights(t.optimizer.state["average"], t.ipu.state)
        final = t.run()  # the steps are done: only the end of training runs
        finished = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    for a, b in zip(raw, km.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    keras_avg = [np.asarray(v) for v in km.optimizer._model_variables_moving_average]
    for a, b in zip(average, keras_avg, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(raw, average, strict=True)) > 1e-3
    km.optimizer.finalize_variable_values(km.trainable_variables)
    for a, b in zip(finished, km.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert final["steps"] == STEPS and not final["terminated"]


def test_overwrite_every_k_steps_gives_the_weights_the_average(rng):
    w0 = rng.normal(size=12).astype(np.float32)
    opt = SGD(w0.copy(), 0.1)
    opt.set_ema(0.5, 3)
    for step in range(1, 7):
        opt.begin_step(0)
        opt.apply(rng.normal(size=12).astype(np.float32), 0, 12)
        same = np.array_equal(opt.params, opt.state["average"])
        assert same == (step % 3 == 0 or step == 1), step  # step 1: the average is the weights
    opt.finalize()
    assert np.array_equal(opt.params, opt.state["average"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"ema_momentum": 1.5}, "ema_momentum=1.5"),
        ({"ema_overwrite_frequency": 0}, "ema_overwrite_frequency=0"),
    ],
)
def test_ema_arguments_keras_refuses_are_refused_naming_them(change, field):
    config = {"learning_rate": 0.01, "use_ema": True, **change}
    with pytest.raises(InvalidSpec, match=f"optimizer.config.{field}"):
        optim.from_compile_config({"optimizer": {"class_name": "SGD", "config": config}})


def test_ema_state_is_counted_and_checkpointed(rng):
    spec = optim.from_compile_config(
        {"optimizer": {"class_name": "Adam", "config": {"use_ema": True}}}
    )
    assert spec is not None and optim.state_arrays(spec) == 3
    opt = optim.build_spec(spec, np.zeros(10, np.float32))
    assert set(opt.state_dict()) == {"m", "v", "average"}
