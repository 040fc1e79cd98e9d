"""The metric registry (``engine.keras_metrics``) against real Keras' stateful metrics: the
same compiled metric, updated batch by batch on the same labels and model outputs (logits
where the loss folded the activation), reports Keras' ``result()``; what is not implemented is
refused by name."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import keras_metrics as KMET

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)

N, BATCH = 97, 32

# (the metric as compile() takes it, the loss kind, the folded activation, labels, outputs k)
CASES = [
    (lambda: keras.metrics.AUC(), "binary", "sigmoid", "bits", 1),
    (lambda: keras.metrics.AUC(curve="PR"), "binary", "sigmoid", "bits", 1),
    (lambda: keras.metrics.AUC(num_thresholds=17, name="a17"), "binary", None, "bits", 3),
    (lambda: keras.metrics.AUC(from_logits=True), "binary", None, "logits", 2),
    (lambda: keras.metrics.Precision(), "binary", "sigmoid", "bits", 1),
    (lambda: keras.metrics.Recall(), "binary", "sigmoid", "bits", 2),
    (lambda: keras.metrics.TopKCategoricalAccuracy(k=2), "categorical", "softmax", "onehot", 6),
    (lambda: "top_k_categorical_accuracy", "categorical", "softmax", "onehot", 7),
    (lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=3), "sparse", "softmax", "ids", 6),
    (lambda: keras.metrics.RootMeanSquaredError(), "regression", None, "float", 2),
    (lambda: keras.metrics.MeanSquaredError(), "regression", None, "float", 2),
    (lambda: "mse", "regression", None, "float", 3),
    (lambda: keras.metrics.MeanAbsolutePercentageError(), "regression", None, "float", 1),
    (lambda: keras.metrics.LogCoshError(), "regression", None, "float", 2),
    (lambda: "msle", "regression", None, "float", 2),
    (lambda: keras.metrics.CosineSimilarity(), "regression", None, "float", 3),
    (lambda: keras.metrics.KLDivergence(), "binary", "sigmoid", "bits", 3),
    (lambda: keras.metrics.Poisson(), "binary", "sigmoid", "bits", 2),
    (lambda: keras.metrics.Hinge(), "binary", None, "logits", 2),
    (lambda: "squared_hinge", "binary", None, "logits", 2),
    (lambda: keras.metrics.CategoricalHinge(), "categorical", "softmax", "onehot", 4),
    (lambda: keras.metrics.BinaryCrossentropy(), "binary", None, "bits", 2),
    (
        lambda: keras.metrics.BinaryCrossentropy(from_logits=True, label_smoothing=0.1),
        "binary", None, "logits", 1,
    ),
    (
        lambda: keras.metrics.CategoricalCrossentropy(label_smoothing=0.1),
        "categorical", "softmax", "onehot", 5,
    ),
    (lambda: keras.metrics.SparseCategoricalCrossentropy(), "sparse", "softmax", "ids", 5),
    (lambda: "sparse_categorical_crossentropy", "sparse", "softmax", "ids", 4),
    (lambda: keras.metrics.TruePositives(), "binary", "sigmoid", "bits", 2),
    (lambda: keras.metrics.FalsePositives(), "binary", "sigmoid", "bits", 2),
    (lambda: keras.metrics.TrueNegatives(), "binary", "sigmoid", "bits", 1),
    (lambda: keras.metrics.FalseNegatives(), "binary", "sigmoid", "bits", 2),
    (lambda: keras.metrics.F1Score(average="macro", threshold=0.5), "binary", "sigmoid", "bits", 3),
    (lambda: keras.metrics.F1Score(average="micro"), "categorical", "softmax", "onehot", 4),
    (
        lambda: keras.metrics.FBetaScore(beta=2.0, average="weighted"),
        "categorical", "softmax", "onehot", 4,
    ),
    (lambda: keras.metrics.R2Score(), "regression", None, "float", 2),
    (lambda: keras.metrics.F1Score(), "categorical", "softmax", "onehot", 3),
    (lambda: keras.metrics.R2Score(class_aggregation=None), "regression", None, "float", 2),
    (
        lambda: keras.metrics.R2Score(class_aggregation="variance_weighted_average"),
        "regression", None, "float", 3,
    ),
    (lambda: keras.metrics.MeanIoU(5, sparse_y_pred=False), "sparse", "softmax", "ids", 5),
    (
        lambda: keras.metrics.MeanIoU(4, sparse_y_true=False, sparse_y_pred=False),
        "categorical", "softmax", "onehot", 4,
    ),
]  # fmt: skip


def _data(kind, k, rng):
    z = rng.normal(0, 2, (N, k)).astype(np.float32)
    if kind == "bits":
        y = rng.integers(0, 2, (N, k)).astype(np.float32)
        z[:5] = 40.0  # saturated sigmoids: probabilities of exactly 1
    elif kind == "onehot":
        y = np.eye(k, dtype=np.float32)[rng.integers(0, k, N)]
    elif kind == "ids":
        y = rng.integers(0, k, N)
    elif kind == "logits":
        y = rng.integers(0, 2, (N, k)).astype(np.float32)
    else:
        y = rng.normal(0, 2, (N, k)).astype(np.float32)
    return z, y


def _keras_output(z, act):
    if act == "sigmoid":
        return keras.activations.sigmoid(z).numpy()
    if act == "softmax":
        return keras.activations.softmax(z).numpy()
    return z


@pytest.mark.parametrize("make, kind, act, labels, k", CASES, ids=lambda v: str(v))
def test_results_equal_keras_stateful_metrics(make, kind, act, labels, k, rng):
    given = make()
    doc = given if isinstance(given, str) else keras.metrics.serialize(given)
    spec = KMET.parse(doc, kind)
    theirs = keras.metrics.get(given) if isinstance(given, str) else given
    if not isinstance(theirs, keras.metrics.Metric):
        theirs = keras.metrics.MeanMetricWrapper(theirs, name=given)
    z, y = _data(labels, k, rng)
    ours = KMET.MetricSet([spec], act, width=k)
    out = _keras_output(z, act)
    for s in range(0, N, BATCH):
        ours.update(z[s : s + BATCH], y[s : s + BATCH])
        theirs.update_state(y[s : s + BATCH], out[s : s + BATCH])
    got = ours.results()
    name = given if isinstance(given, str) else theirs.name  # compile names a string metric so
    want = np.asarray(theirs.result())
    if want.ndim:  # one value per class, reported as name_0, name_1, ...
        assert list(got) == [f"{name}_{i}" for i in range(len(want))]
        np.testing.assert_allclose(list(got.values()), want, rtol=1e-5, atol=1e-6)
        return
    assert list(got) == [name]
    assert got[name] == pytest.approx(float(want), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "doc, kind, words",
    [
        (keras.metrics.serialize(keras.metrics.AUC(multi_label=True)), "binary", "multi_label"),
        (keras.metrics.serialize(keras.metrics.Precision(thresholds=0.3)), "binary", "thresholds"),
        (keras.metrics.serialize(keras.metrics.Recall(top_k=2)), "binary", "top_k"),
        ("precision", "sparse", "with a sparse loss"),
        ("top_k_categorical_accuracy", "sparse", "with a sparse loss"),
        (keras.metrics.serialize(keras.metrics.BinaryIoU()), "binary", "BinaryIoU"),
        (keras.metrics.serialize(keras.metrics.IoU(2, target_class_ids=[0])), "sparse", "IoU"),
        (keras.metrics.serialize(keras.metrics.R2Score(num_regressors=2)), "regression", "num_reg"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(doc, kind, words):
    with pytest.raises(InvalidSpec, match=words):
        KMET.parse(doc, kind)


def _trained(tmp_path, km, x, y, classes):
    import io

    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.data.split import Dataset, Split
    from ringtrain_trainer.worker import Trainer

    km.save(tmp_path / "m.keras")
    data = Dataset("t", Split(x[:64], y[:64]), Split(x[64:], y[64:]), classes)
    args = ["--model", str(tmp_path / "m.keras"), "--steps", "3", "--batch-size", "16"]
    args += ["--ipu-host-threads", "1"]
    out = io.StringIO()
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), data, out=out)
    return t, out


@pytest.mark.parametrize("family", ["binary", "regression"])
def test_the_chief_reports_keras_evaluate_s_metrics(family, tmp_path, rng):
    """A model compiled with these metrics, trained three steps: the chief's evaluation (the
    Eval event, ``/status``) equals ``model.evaluate`` on the same weights and test split."""
    keras.utils.set_random_seed(1)
    x = rng.normal(0, 1, (101, 6)).astype(np.float32)
    if family == "binary":
        y = (x[:, :1] + 0.5 * rng.normal(size=(101, 1)) > 0).astype(np.float32)
        metrics = [keras.metrics.AUC(), keras.metrics.AUC(curve="PR", name="pr"), "precision"]
        metrics += [keras.metrics.Recall(), "binary_crossentropy", keras.metrics.TruePositives()]
        metrics += [keras.metrics.F1Score(average="micro", threshold=0.5)]
        last, loss = keras.layers.Dense(1, activation="sigmoid"), "binary_crossentropy"
    else:
        y = (x[:, :2] * 2 + 3).astype(np.float32)
        metrics = ["mse", keras.metrics.RootMeanSquaredError(), "mape", "mae"]
        metrics += [keras.metrics.R2Score(), keras.metrics.LogCoshError()]
        last, loss = keras.layers.Dense(2), "log_cosh"
    km = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"), last])
    km.compile(optimizer=keras.optimizers.Nadam(0.01), loss=loss, metrics=metrics)
    t, out = _trained(tmp_path, km, x, y, 2)
    try:
        for _ in range(3):
            t.train_one_step()
        t.evaluate()
        km.set_weights(t.spec.keras_weights(t.params, t.state))
        want = km.evaluate(x[64:], y[64:], verbose=0, return_dict=True)
        got = t.metrics.status()["test_metrics"]
        assert set(got) | {"loss", "mae", "compile_metrics"} >= set(want) - {"compile_metrics"}
        for name, value in got.items():
            assert value == pytest.approx(want[name], rel=1e-4, abs=1e-5), name
        name, value = next(iter(got.items()))
        assert f"{name} {value:.4f}" in out.getvalue()  # the chief's eval line names them
    finally:
        t.close()


def test_replicas_summed_state_is_one_pass_over_the_whole_set(rng):
    """What the chief's shared evaluation does: each worker's share, states summed (in float32,
    as the ring carries them), equals one pass over everything."""
    specs = [
        KMET.parse(keras.metrics.serialize(keras.metrics.AUC(curve="PR")), "binary"),
        KMET.parse("precision", "binary"),
        KMET.parse("recall", "binary"),
        KMET.parse("mse", "binary"),
    ]
    z, y = _data("bits", 3, rng)
    whole = KMET.MetricSet(specs, "sigmoid")
    whole.update(z, y)
    parts = [KMET.MetricSet(specs, "sigmoid") for _ in range(2)]
    parts[0].update(z[:40], y[:40])
    parts[1].update(z[40:], y[40:])
    summed = KMET.MetricSet(specs, "sigmoid")
    summed.set_state(sum(p.state().astype(np.float32) for p in parts).astype(np.float64))
    got, want = summed.results(), whole.results()
    assert len(got) == 4 and list(got)[1:] == ["precision", "recall", "mse"]
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-6), name
