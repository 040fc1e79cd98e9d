"""Keras ``Permute``, ``RepeatVector``, ``PReLU``, ``CenterCrop``: the ops' gradients against finite
differences, and models built by real Keras trained by ringtrain and by Keras from the same
``.keras`` weights on the same batches (loss at every step, predictions after), the export
reloaded by Keras and run by onnxruntime."""

from __future__ import annotations

import os

import pytest
from support.opcheck import check_gradients

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from test_keras_wrap_layers import _config, check_exports, train_like_keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.prelu import PReLU
from ringtrain_trainer.engine.ops.rearrange import Permute, RepeatVector
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


@pytest.mark.parametrize(
    "op",
    [Permute((3, 4, 2), (2, 1, 3)), Permute((3, 4, 2), (3, 1, 2)), RepeatVector((5,), 3)],
    ids=["swap", "rotate", "repeat"],
)
def test_rearranging_ops_gradients(op, rng):
    check_gradients(op, rng)


MODELS = {
    # keras.io's "sequence to sequence addition": encode, repeat, decode per step
    "repeat_vector": lambda: keras.Sequential(
        [
            L.Input((6, 3)),
            L.LSTM(5),
            L.RepeatVector(4),
            L.SimpleRNN(6, return_sequences=True),
            L.Flatten(),
            L.Dense(4, activation="softmax"),
        ]
    ),
    # time and features swapped before a Conv1D over the other axis
    "permute": lambda: keras.Sequential(
        [
            L.Input((5, 4, 2)),
            L.Permute((2, 1, 3)),
            L.Conv2D(3, 2, activation="relu"),
            L.Reshape((3, 12)),
            L.Permute((2, 1)),
            L.Conv1D(2, 2),
            L.Flatten(),
            L.Dense(4, activation="softmax"),
        ]
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_rearranging_layers_train_like_keras_and_export(name, tmp_path, rng):
    km = MODELS[name]()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


@pytest.mark.parametrize(
    "layer,shape,arg,value,match",
    [
        (L.Permute((2, 1, 3)), (3, 4, 2), "dims", [2, 1, 1], r"dims=\[2, 1, 1\] is no permutation"),
        (L.RepeatVector(2), (3,), "n", 0, r"n=0 is not supported"),
    ],
)
def test_rearranging_layers_that_do_not_fit_are_refused_naming_them(
    layer, shape, arg, value, match
):
    config = _config(layer, shape=shape)
    config["config"]["layers"][1]["config"][arg] = value
    with pytest.raises(InvalidSpec, match=match):
        parse(config, compiled=False)


@pytest.mark.parametrize(
    "op",
    [PReLU((3, 4, 2), (1, 1, 2)), PReLU((5,), (5,))],
    ids=["shared_hw", "per_unit"],
)
def test_prelu_gradients(op, rng):
    check_gradients(op, rng)


def test_prelu_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            L.Conv2D(3, 3),
            L.PReLU(alpha_initializer=keras.initializers.Constant(0.25), shared_axes=[1, 2]),
            L.Flatten(),
            L.Dense(5),
            L.PReLU(alpha_initializer="random_uniform"),
            L.Dense(4, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


def test_center_crop_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((9, 8, 2)),
            L.CenterCrop(6, 5),
            L.Conv2D(3, 3, activation="relu"),
            L.Flatten(),
            L.Dense(4, activation="softmax"),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    check_exports(*train_like_keras(km, tmp_path, rng), tmp_path)


def test_a_center_crop_larger_than_its_input_is_refused_naming_it():
    config = _config(L.CenterCrop(4, 4), shape=(6, 6, 1))
    config["config"]["layers"][1]["config"]["height"] = 8
    with pytest.raises(InvalidSpec, match=r"height=8 is larger than the input's 6"):
        parse(config, compiled=False)
