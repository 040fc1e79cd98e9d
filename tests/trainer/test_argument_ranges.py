"""Layer, initializer, regularizer, constraint, optimizer, schedule and metric arguments outside
their meaningful range are refused when the model is read (``keras.load.from_config``: what
``ringtrain render``, ``ringtrain run`` and the operator's admission run alike), with a message
naming the argument and the range (decision 0205): never a traceback, never a model that trains
to a "Succeeded" job with non-finite statistics (issue 35).

The fuzz test generates values of any JSON type for representative arguments and asserts "an
``InvalidSpec`` naming the argument, or a model that builds" — a fixed budget of examples, no
deadline.
"""

import copy
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import fuzz

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import load as KL

L = keras.layers


def _model() -> dict:
    m = keras.Sequential(
        [
            L.Input((6,)),
            L.Dense(4, kernel_initializer="he_normal"),
            L.BatchNormalization(),
            L.Dropout(0.1),
            L.GaussianNoise(0.1),
            L.Dense(3, activation="softmax"),
        ]
    )
    m.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    doc = json.loads(m.to_json())
    doc["compile_config"] = m.get_compile_config()
    return json.loads(json.dumps(doc))


BASE = _model()
#: (what is set, its path in the model document, the word the refusal must name)
LAYER = {"dense": 1, "batch_normalization": 2, "dropout": 3, "gaussian_noise": 4}


def _build(doc: dict) -> None:
    """Read the model as the spec check does, then draw its fresh weights as a worker does:
    what passes the check must not crash there."""
    spec = KL.from_config(doc)
    spec.init(0)
    spec.init_state()


def _with(path: tuple, value) -> dict:
    doc = copy.deepcopy(BASE)
    at = doc
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return doc


def _layer(i: int, *keys: str) -> tuple:
    return ("config", "layers", i, "config", *keys)


def _opt(*keys: str) -> tuple:
    return ("compile_config", "optimizer", "config", *keys)


CASES = {
    "momentum": (_layer(2, "momentum"), 2.0),
    "epsilon": (_layer(2, "epsilon"), -1.0),
    "rate": (_layer(3, "rate"), 1.0),
    "stddev": (_layer(4, "stddev"), float("inf")),
    "units": (_layer(1, "units"), 0),
    "kernel_initializer.config.stddev": (
        _layer(1, "kernel_initializer"),
        {"class_name": "RandomNormal", "config": {"stddev": -1.0}},
    ),
    "kernel_initializer.config.scale": (
        _layer(1, "kernel_initializer"),
        {"class_name": "VarianceScaling", "config": {"scale": "2"}},
    ),
    "kernel_initializer.config.minval": (
        _layer(1, "kernel_initializer"),
        {"class_name": "RandomUniform", "config": {"minval": 1.0, "maxval": -1.0}},
    ),
    "mode": (
        _layer(1, "kernel_initializer"),
        {"class_name": "VarianceScaling", "config": {"mode": "fan_sideways"}},
    ),
    "Identity": (_layer(1, "bias_initializer"), "identity"),
    "kernel_regularizer": (
        _layer(1, "kernel_regularizer"),
        {"class_name": "L2", "config": {"l2": -0.1}},
    ),
    "max_value": (
        _layer(1, "kernel_constraint"),
        {"class_name": "MaxNorm", "config": {"max_value": -1, "axis": 0}},
    ),
    "min_value": (
        _layer(1, "kernel_constraint"),
        {"class_name": "MinMaxNorm", "config": {"min_value": 2.0, "max_value": 1.0}},
    ),
    "optimizer.config.epsilon": (_opt("epsilon"), -1),
    "optimizer.config.beta_1": (_opt("beta_1"), 1.0),
    "optimizer.config.learning_rate": (_opt("learning_rate"), float("nan")),
    "decay_steps": (
        _opt("learning_rate"),
        {
            "class_name": "ExponentialDecay",
            "config": {"initial_learning_rate": 0.1, "decay_steps": 0, "decay_rate": 0.5},
        },
    ),
    "SparseTopKCategoricalAccuracy.k": (
        ("compile_config", "metrics"),
        [{"class_name": "SparseTopKCategoricalAccuracy", "config": {"k": 0}}],
    ),
}


@pytest.mark.parametrize("word", list(CASES))
def test_a_value_outside_its_range_is_refused_naming_the_argument(word):
    path, value = CASES[word]
    with pytest.raises(InvalidSpec, match=word.replace(".", r"\.")):
        KL.from_config(_with(path, value))


def test_the_model_itself_builds():
    _build(copy.deepcopy(BASE))


#: representative arguments: (path, the word a refusal names)
FUZZED = [
    (_layer(2, "momentum"), "momentum"),
    (_layer(2, "epsilon"), "epsilon"),
    (_layer(3, "rate"), "rate"),
    (_layer(4, "stddev"), "stddev"),
    (_layer(1, "units"), "units"),
    (_opt("epsilon"), "epsilon"),
    (_opt("beta_2"), "beta_2"),
    (_opt("learning_rate"), "learning_rate"),
    (_opt("amsgrad"), "amsgrad"),
]
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(0, 2), max_size=2),
)
_INIT = st.fixed_dictionaries(
    {
        "class_name": st.sampled_from(
            ["RandomNormal", "RandomUniform", "TruncatedNormal", "VarianceScaling", "Constant"]
        ),
        "config": st.dictionaries(
            st.sampled_from(
                ["mean", "stddev", "minval", "maxval", "scale", "mode", "distribution", "value"]
            ),
            JSON_VALUES,
            max_size=2,
        ),
    }
)
_CONSTRAINT = st.fixed_dictionaries(
    {
        "class_name": st.sampled_from(["MaxNorm", "MinMaxNorm", "UnitNorm"]),
        "config": st.dictionaries(
            st.sampled_from(["max_value", "min_value", "rate", "axis"]), JSON_VALUES, max_size=2
        ),
    }
)


@fuzz(50)
@given(st.sampled_from(FUZZED), JSON_VALUES)
def test_any_value_of_an_argument_is_refused_by_name_or_builds(where, value):
    path, word = where
    try:
        _build(_with(path, value))
    except InvalidSpec as e:
        assert word in str(e), str(e)


@fuzz(50)
@given(_INIT, _CONSTRAINT)
def test_any_initializer_or_constraint_is_refused_by_name_or_builds(init, constraint):
    for key, value in (("kernel_initializer", init), ("kernel_constraint", constraint)):
        try:
            _build(_with(_layer(1, key), value))
        except InvalidSpec as e:
            assert key in str(e), str(e)
