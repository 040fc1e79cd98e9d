"""Every argument of every compiled metric, loss and optimizer the registries accept is honoured
(the same numbers as real Keras) or refused by name before anything runs (decision 0205).

For each registry entry, each of its Keras config arguments (and each the registry itself
knows) gets a non-default value in a config as ``model.compile`` serializes it; ringtrain
either refuses it with an ``InvalidSpec`` naming that argument, or evaluates exactly what real
Keras evaluates for the same config (``keras.*.deserialize`` of the same document: what a
reloaded Keras model runs). A registry entry or argument without a case here fails
``test_every_argument_has_a_case``, so a new one cannot slip through. A
``BinaryAccuracy(threshold=0.0)`` on logits (TensorFlow's text-classification tutorial) was
evaluated at 0.5: the case that found it is ``BinaryAccuracy-threshold``.
"""

import copy
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from test_keras_metrics import BATCH, N, _data, _keras_output
from test_loss_fns_keras import CASES as LOSS_FN_CASES
from test_loss_fns_keras import values
from test_optim_keras import SHAPES, run_both

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import optim
from ringtrain_trainer.engine import keras_metrics as KMET
from ringtrain_trainer.engine import loss_spec as LSP
from ringtrain_trainer.engine import losses as LS
from ringtrain_trainer.keras import compile as KC
from ringtrain_trainer.optim import registry as OPT

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)
BOOKKEEPING = ("name", "dtype")

# -- metrics -----------------------------------------------------------------------------------
#: class → (loss kind, folded activation, labels, outputs) it is evaluated with
_BITS, _ONEHOT = ("binary", "sigmoid", "bits", 2), ("categorical", "softmax", "onehot", 4)
_FLOAT = ("regression", None, "float", 2)
METRIC_CONTEXT = {
    "AUC": _BITS, "Precision": _BITS, "Recall": _BITS,
    # unfolded: a numpy output has no ``_keras_logits`` (a Keras model's sigmoid output has)
    "BinaryCrossentropy": ("binary", None, "bits", 2),
    "TruePositives": _BITS, "FalsePositives": _BITS, "TrueNegatives": _BITS,
    "FalseNegatives": _BITS, "BinaryAccuracy": ("binary", None, "logits", 2),
    "TopKCategoricalAccuracy": ("categorical", "softmax", "onehot", 6),
    "SparseTopKCategoricalAccuracy": ("sparse", "softmax", "ids", 6),
    "CategoricalCrossentropy": _ONEHOT, "CategoricalHinge": _ONEHOT, "F1Score": _ONEHOT,
    "FBetaScore": _ONEHOT, "SparseCategoricalCrossentropy": ("sparse", "softmax", "ids", 5),
    "MeanIoU": ("sparse", "softmax", "ids", 5),
}  # fmt: skip
#: class → {argument: a non-default value}; a value may carry its own context (value, context)
METRIC_VALUES: dict[str, dict] = {
    "AUC": {
        "num_thresholds": 17, "curve": "PR", "summation_method": "minoring",
        "multi_label": True, "num_labels": 2, "label_weights": [0.3, 0.7],
        "from_logits": (True, ("binary", None, "logits", 2)),
    },
    "Precision": {"thresholds": 0.3, "top_k": 1, "class_id": 1},
    "Recall": {"thresholds": 0.3, "top_k": 1, "class_id": 1},
    "BinaryAccuracy": {"threshold": 0.0},
    "TopKCategoricalAccuracy": {"k": 2},
    "SparseTopKCategoricalAccuracy": {"k": 3, "from_sorted_ids": True},
    "CosineSimilarity": {"axis": 0},
    "BinaryCrossentropy": {"from_logits": True, "label_smoothing": 0.2},
    "CategoricalCrossentropy": {"from_logits": True, "label_smoothing": 0.1, "axis": 0},
    "SparseCategoricalCrossentropy": {"from_logits": True, "ignore_class": 1, "axis": 0},
    **{c: {"thresholds": 0.3} for c in KMET._COUNTS},
    "F1Score": {"average": "micro", "threshold": 0.4},
    "FBetaScore": {"average": "macro", "threshold": 0.3, "beta": 2.0},
    "R2Score": {"class_aggregation": "variance_weighted_average", "num_regressors": 1},
    "MeanIoU": {
        "num_classes": 4, "ignore_class": 1, "sparse_y_pred": True, "axis": 0,
        "sparse_y_true": (False, ("categorical", "softmax", "onehot", 5)),
    },
}  # fmt: skip


def _default_metric(cls: str):
    iou = {"num_classes": 5, "sparse_y_pred": False}  # the output: a score per class
    return getattr(keras.metrics, cls)(**(iou if cls == "MeanIoU" else {}))


def _metric_keys(cls: str) -> set[str]:
    keras_keys = set(_default_metric(cls).get_config()) - set(BOOKKEEPING)
    return keras_keys | set(KMET.ENTRIES[cls][2])


METRIC_CASES = [(c, k) for c in KMET.ENTRIES for k in sorted(_metric_keys(c))]


@pytest.mark.parametrize("cls, key", METRIC_CASES, ids=lambda v: str(v))
def test_a_metric_argument_is_honoured_or_refused_by_name(cls, key, rng):
    value = METRIC_VALUES[cls][key]
    value, context = value if isinstance(value, tuple) else (value, None)
    kind, act, labels, k = context or METRIC_CONTEXT.get(cls, _FLOAT)
    doc = keras.metrics.serialize(_default_metric(cls))
    doc["config"][key] = value
    try:
        specs = KC.compiled_metrics([copy.deepcopy(doc)], kind)
    except InvalidSpec as e:
        assert f".{key}" in str(e), str(e)
        return
    # not dropped into the loss's own metric: evaluated as its registry entry
    assert len(specs) == 1, f"{cls}({key}={value!r}) was dropped"
    theirs = keras.metrics.deserialize(doc)
    z, y = _data(labels, k, rng)
    ours = KMET.MetricSet(specs, act, width=k)
    out = _keras_output(z, act)
    for s in range(0, N, BATCH):
        ours.update(z[s : s + BATCH], y[s : s + BATCH])
        theirs.update_state(y[s : s + BATCH], out[s : s + BATCH])
    want = np.asarray(theirs.result(), np.float64).ravel()
    np.testing.assert_allclose(list(ours.results().values()), want, rtol=1e-5, atol=1e-6)


def test_binary_accuracy_at_threshold_0_on_logits_is_keras_s(rng):
    """The tutorial's case at the compile level: a model without its sigmoid, compiled with
    ``BinaryCrossentropy(from_logits=True)`` and ``BinaryAccuracy(threshold=0.0)``."""
    doc = keras.metrics.serialize(keras.metrics.BinaryAccuracy(threshold=0.0))
    loss_doc = {"class_name": "BinaryCrossentropy", "config": {"from_logits": True}}
    loss, _ = KC.read({"loss": loss_doc, "metrics": [doc]}, None)
    specs = KC.compiled_metrics([doc], loss.kind)
    z = rng.normal(-0.3, 1.0, (200, 1))
    y = (rng.random((200, 1)) < 0.5).astype(np.float32)
    ours = KMET.MetricSet(specs, loss.folded)
    ours.update(z, y)
    want = float(np.mean((z > 0.0) == y))
    assert ours.results() == {"binary_accuracy": pytest.approx(want)}
    assert want != pytest.approx(float(np.mean((z > 0.5) == y)))  # 0.5 would differ here


# -- losses ------------------------------------------------------------------------------------
LOSS_VALUES: dict[str, dict] = {
    "SparseCategoricalCrossentropy": {"from_logits": True, "ignore_class": 1},
    "CategoricalCrossentropy": {"from_logits": True, "label_smoothing": 0.1, "axis": 0},
    "BinaryCrossentropy": {"from_logits": True, "label_smoothing": 0.1, "axis": 0},
    "Huber": {"delta": 0.4},
    "CosineSimilarity": {"axis": 0},
}
#: the output the model gives and the labels, per kind or per regression loss
_LOSS_DATA = {c: (z, y) for c, _, z, y in LOSS_FN_CASES}
_LOSS_DATA |= {"MeanSquaredError": ("any", "float"), "MeanAbsoluteError": ("any", "float")}
_LOSS_DATA |= {"Huber": ("any", "float")}
_ACT = {"sparse": "softmax", "categorical": "softmax", "binary": "sigmoid"}
B, K = 6, 4


def _loss_keys(cls: str) -> list[str]:
    keras_keys = set(getattr(keras.losses, cls)().get_config()) - set(BOOKKEEPING)
    return sorted(keras_keys | set(LSP._ENTRIES[cls][2]))


LOSS_CASES = [(c, k) for c in LSP._ENTRIES for k in _loss_keys(c)]


@pytest.mark.parametrize("cls, key", LOSS_CASES, ids=lambda v: str(v))
def test_a_loss_argument_is_honoured_or_refused_by_name(cls, key, rng):
    value = "sum" if key == "reduction" else LOSS_VALUES[cls][key]
    doc = keras.losses.serialize(getattr(keras.losses, cls)())
    doc["config"][key] = value
    try:
        spec = LSP.parse(copy.deepcopy(doc))
    except InvalidSpec as e:
        assert f".{key}" in str(e), str(e)
        return
    kind = spec.kind
    act = None if spec.arg("from_logits") or kind == "regression" else _ACT[kind]
    spec = LSP.fold(spec, act)
    if kind == "sparse":
        z, y = values("any", rng), rng.integers(0, K, B)
    elif kind in ("categorical", "binary"):
        z, y = values("any", rng), values("onehot" if kind == "categorical" else "bits", rng)
    else:
        zk, yk = _LOSS_DATA[cls]
        z, y = values(zk, rng), values(yk, rng)
    out = _keras_output(z, act)
    want = float(keras.losses.deserialize(doc)(y, out))
    loss = LS.Loss(spec, B, K)
    np.copyto(loss.labels, y)
    assert loss.step(z) == pytest.approx(want, rel=1e-5, abs=1e-6)


# -- optimizers --------------------------------------------------------------------------------
#: argument → a non-default value (and the arguments it needs to matter)
OPT_VALUES: dict[str, tuple] = {
    "learning_rate": (0.02, {}), "weight_decay": (0.02, {}), "clipnorm": (0.5, {}),
    "global_clipnorm": (0.7, {}), "clipvalue": (0.3, {}), "use_ema": (True, {}),
    "ema_momentum": (0.9, {"use_ema": True}),
    "ema_overwrite_frequency": (3, {"use_ema": True}),
    "loss_scale_factor": (2.0, {}), "gradient_accumulation_steps": (2, {}),
    "momentum": (0.5, {}), "nesterov": (True, {"momentum": 0.5}), "beta_1": (0.8, {}),
    "beta_2": (0.95, {}), "epsilon": (1e-3, {}), "amsgrad": (True, {}), "rho": (0.8, {}),
    "centered": (True, {}), "initial_accumulator_value": (0.5, {}),
    "beta_2_decay": (-0.6, {}), "epsilon_1": (1e-20, {}), "epsilon_2": (1e-2, {}),
    "clip_threshold": (0.5, {}), "relative_step": (False, {}),
    "learning_rate_power": (-0.7, {}), "l1_regularization_strength": (0.01, {}),
    "l2_regularization_strength": (0.02, {}),
    "l2_shrinkage_regularization_strength": (0.03, {}), "beta": (0.1, {}),
}  # fmt: skip


def _opt_keys(cls: str) -> list[str]:
    keras_keys = set(getattr(keras.optimizers, cls)().get_config()) - set(BOOKKEEPING)
    return sorted(keras_keys | set(OPT.BASE) | set(OPT.KERAS[cls][1]))


OPT_CASES = [(c, k) for c in OPT.KERAS for k in _opt_keys(c)]


@pytest.mark.parametrize("cls, key", OPT_CASES, ids=lambda v: str(v))
def test_an_optimizer_argument_is_honoured_or_refused_by_name(cls, key, rng, monkeypatch):
    value, needs = OPT_VALUES[key]
    kwargs = {**needs, key: value}
    if cls == "Ftrl" and key == "learning_rate":
        kwargs[key] = 0.2
    make = lambda: getattr(keras.optimizers, cls)(**kwargs)  # noqa: E731
    try:
        OPT.from_compile_config({"optimizer": keras.optimizers.serialize(make())})
    except InvalidSpec as e:
        assert f".{key}" in str(e), str(e)
        return
    if cls == "Adafactor":  # its factored moments need each tensor's shape
        build = optim.build_spec

        def with_shapes(spec, params, tensors):
            opt = build(spec, params, tensors)
            opt.set_shapes([(a, b, s) for (a, b), s in zip(tensors, SHAPES, strict=True)])
            return opt

        monkeypatch.setattr(optim, "build_spec", with_shapes)
    got, want = run_both(make, rng)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_every_argument_has_a_case():
    for cls, key in METRIC_CASES:
        assert key in METRIC_VALUES.get(cls, {}), f"metric {cls}.{key} has no case"
    for cls, key in LOSS_CASES:
        assert key == "reduction" or key in LOSS_VALUES.get(cls, {}), f"loss {cls}.{key}"
    for cls, key in OPT_CASES:
        assert key in OPT_VALUES, f"optimizer {cls}.{key} has no case"
