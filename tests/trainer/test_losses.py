"""The loss registry's refusals (every unsupported field named, before anything runs), the
labels checked against the loss, and a worker training on each family end to end. Numbers
against real Keras are in test_losses_keras.py."""

import io
import json

import numpy as np
import pytest
from test_keras_layers import layer, seq

from ringtrain.errors import DataError, InvalidSpec
from ringtrain_trainer.checkpoint.store import CheckpointManager
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.fit import check_fits
from ringtrain_trainer.data.npz import load_npz
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.engine import loss_spec as LSP
from ringtrain_trainer.engine import losses as LS
from ringtrain_trainer.evaluator import Evaluator
from ringtrain_trainer.keras import load as KM
from ringtrain_trainer.telemetry.metrics import TrainerMetrics
from ringtrain_trainer.worker_main import main as worker_main


def model(loss, out=3, act="linear", metrics=None):
    m = seq((4,), layer("Dense", "h", units=5, activation="relu"), layer("Dense", "o", units=out))
    m["config"]["layers"][-1]["config"]["activation"] = act
    m["compile_config"] = {"loss": loss, "metrics": metrics}
    return m


@pytest.mark.parametrize(
    "loss, words",
    [
        ("binary_focal_crossentropy", r"compile_config.loss=.binary_focal_crossentropy. is not"),
        ({"class_name": "Dice", "config": {}}, r"compile_config.loss.class_name=.Dice."),
        (
            {"class_name": "MeanSquaredError", "config": {"reduction": "sum"}},
            r"compile_config.loss.config.reduction='sum' is not supported "
            r"\(supported: 'sum_over_batch_size'\)",
        ),
        (
            {"class_name": "CategoricalCrossentropy", "config": {"axis": 0}},
            r"compile_config.loss.config.axis=0 is not supported",
        ),
        (
            {"class_name": "BinaryCrossentropy", "config": {"label_smoothing": 2}},
            r"compile_config.loss.config.label_smoothing=2 is not supported",
        ),
        (
            {"class_name": "Huber", "config": {"delta": -1}},
            r"compile_config.loss.config.delta=-1 is not supported",
        ),
        (
            {"class_name": "MeanSquaredError", "config": {"from_logits": True}},
            r"compile_config.loss.config.from_logits: MeanSquaredError argument not supported",
        ),
        (["mse", "mae"], r"compile_config.loss=\['mse', 'mae'\] is not supported"),
    ],
)
def test_unsupported_loss_fields_are_refused_naming_them(loss, words):
    with pytest.raises(InvalidSpec, match=words):
        KM.from_config(model(loss))


def test_a_probability_loss_needs_its_activation_or_from_logits():
    with pytest.raises(
        InvalidSpec, match=r"BinaryCrossentropy with from_logits=False needs .*sigm"
    ):
        KM.from_config(model("binary_crossentropy", out=1))
    with pytest.raises(InvalidSpec, match=r"CategoricalCrossentropy with from_logits=False .*soft"):
        KM.from_config(model("categorical_crossentropy", act="relu"))
    # Keras would read the sigmoid's input (its _keras_logits) as softmax logits: refused
    with pytest.raises(InvalidSpec, match="last layer is a sigmoid: Keras computes it from"):
        KM.from_config(model({"class_name": "CategoricalCrossentropy",
                              "config": {"from_logits": True}}, act="sigmoid"))  # fmt: skip
    with pytest.raises(InvalidSpec, match="last layer is a softmax: Keras computes it from"):
        KM.from_config(model("binary_crossentropy", act="softmax"))
    with pytest.raises(InvalidSpec, match="a classifier needs one score per class"):
        KM.from_config(model("sparse_categorical_crossentropy", out=1, act="softmax"))


@pytest.mark.parametrize(
    "loss, act", [("sparse_categorical_crossentropy", "softmax"), ("mse", "linear")]
)
def test_a_per_timestep_output_reads_a_loss_per_position(loss, act):
    # a tagger's head, Dense(num_tags, softmax) on (batch, T, features); issue 19
    m = seq((20, 4), layer("Dense", "o", units=5, activation=act))
    m["compile_config"] = {"loss": loss, "metrics": None}
    spec = KM.from_config(m).loss
    assert (spec.out_shape, spec.positions) == ((20, 5), 20)
    assert spec.describe().endswith(" per position of (20,)")  # the start-up log says so
    loss_ = LS.Loss(spec, 3, 5)
    assert loss_.labels.shape == ((3, 20) if spec.kind == "sparse" else (3, 100))
    assert loss_.grad.shape == (3, 20, 5)  # shaped like the output, for its backward


@pytest.mark.parametrize(
    "loss, metric",
    [
        ("mse", "accuracy"),
        ("binary_crossentropy", "precision_at_recall"),
        ("categorical_crossentropy", "iou"),
    ],
)
def test_metrics_other_than_the_losss_own_are_refused_naming_compile_config_metrics(loss, metric):
    act = {"binary_crossentropy": "sigmoid", "categorical_crossentropy": "softmax"}.get(loss)
    with pytest.raises(InvalidSpec, match=f"compile_config.metrics: metric '{metric}'"):
        KM.from_config(model(loss, act=act or "linear", metrics=[metric]))


def test_the_folded_activation_leaves_the_model_and_a_regression_output_keeps_its_own():
    bce = KM.from_config(model("binary_crossentropy", out=1, act="sigmoid", metrics=["accuracy"]))
    assert bce.loss.folded == "sigmoid" and bce.num_classes == 1
    assert bce.keras_config()["compile_config"]["loss"]["class_name"] == "BinaryCrossentropy"
    mse = KM.from_config(model("mse", out=2, act="sigmoid", metrics=["mae"]))
    assert mse.loss.folded is None and mse.layers[-1].act == "sigmoid"
    assert mse.loss.describe() == "MeanSquaredError()"
    cnn = KM.load("cnn").loss  # the presets: sparse cross-entropy from logits, as before
    assert (cnn.name, cnn.arg("from_logits"), cnn.folded) == (LSP.DEFAULT.name, True, None)


def _ds(y_train, y_test=None):
    x = np.zeros((len(y_train), 4), np.float32)
    te = y_train if y_test is None else y_test
    return Dataset("d", Split(x, y_train), Split(x[: len(te)], te))


@pytest.mark.parametrize(
    "loss, y, words",
    [
        ("sparse_categorical_crossentropy", np.eye(3, dtype=np.float32), "needs integer class"),
        ("categorical_crossentropy", np.arange(3), "has integer class ids; Categorical"),
        ("categorical_crossentropy", np.full((3, 3), 1 / 3, np.float32), "needs one-hot rows"),
        ("binary_crossentropy", np.full((3, 3), 1.5, np.float32), "needs labels between 0 and 1"),
        ("mse", np.zeros((3, 2), np.float32), "has rows of 2; MeanSquaredError needs float rows"),
    ],
)
def test_labels_that_do_not_suit_the_loss_are_refused_naming_file_and_array(loss, y, words):
    spec = LSP.fold(LSP.parse(loss), {"binary_crossentropy": "sigmoid"}.get(loss, "softmax"))
    with pytest.raises(DataError, match=f"d.npz: y_train.*{words}"):
        check_fits(_ds(y), (4,), 3, "d.npz", spec)


def _npz(path, y_train, y_test, n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (n + 16, 2, 2)).astype(np.float32)  # fed row-major to (4,)
    np.savez(path, x_train=x[:n], y_train=y_train, x_test=x[n:], y_test=y_test)


@pytest.mark.parametrize(
    "loss, act, out, make",
    [
        ("mse", "linear", 2, lambda r, n: r.normal(0, 1, (n, 2)).astype(np.float32)),
        ("binary_crossentropy", "sigmoid", 1, lambda r, n: r.integers(0, 2, n).astype(np.float32)),
        (
            {"class_name": "CategoricalCrossentropy", "config": {"label_smoothing": 0.1}},
            "softmax",
            3,
            lambda r, n: np.eye(3, dtype=np.float32)[r.integers(0, 3, n)],
        ),
    ],
    ids=["mse", "binary", "categorical"],
)
def test_a_worker_trains_and_evaluates_each_family_and_names_its_loss(
    loss, act, out, make, tmp_path, capsys
):
    rng = np.random.default_rng(1)
    _npz(tmp_path / "d.npz", make(rng, 64), make(rng, 16))
    assert load_npz(tmp_path / "d.npz").train.labels.dtype == np.float32
    (tmp_path / "m.json").write_text(json.dumps(model(loss, out=out, act=act)))
    argv = ["--model", str(tmp_path / "m.json"), "--data", str(tmp_path / "d.npz")]
    argv += [
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--json",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    ]
    argv += ["--termination-log", str(tmp_path / "log")]
    assert worker_main(argv) == 0
    final = json.loads((tmp_path / "log").read_text())
    assert np.isfinite(final["loss"])
    if act == "linear":  # regression: the MAE, never an "accuracy"
        assert final["test_accuracy"] is None and 0 < final["test_mae"] < 10
    else:
        assert 0 <= final["test_accuracy"] <= 1 and "test_mae" not in final
    name = LSP.parse(loss).name
    assert f"loss {name}(" in capsys.readouterr().err
    state, _ = CheckpointManager(tmp_path / "ck").load_latest()
    assert state.loss_config["keras"]["class_name"] == name
    # the Evaluator: the same registry, in float64, on the whole test split
    tf_config = '{"cluster":{"worker":["127.0.0.1:1"]},"task":{"type":"evaluator","index":0}}'
    ev_argv = [*argv[:4], "--checkpoint-dir", str(tmp_path / "ck")]
    cfg = TrainerConfig.from_args(ev_argv, {"TF_CONFIG": tf_config})
    ev = Evaluator(cfg, TrainerMetrics(), io.StringIO())
    loss_ev, metric = ev.evaluate(state)
    test = ev.data.test
    out = ev.program.forward(ev.spec.views(state.params))[: len(test)]
    lossfn = LS.Loss(ev.spec.loss, len(test), ev.spec.num_classes)
    assert loss_ev == pytest.approx(lossfn.total(out, test.labels) / len(test), rel=1e-6)
    assert metric == pytest.approx(final["test_mae" if act == "linear" else "test_accuracy"])
    ev.evaluate_new()
    assert (ev.evaluated[-1].test_mae is not None) == (act == "linear")
    assert ("test_mae" in ev.metrics.status()) == (act == "linear")


def _old_fused_softmax_ce(z, labels, dtype=np.float32):
    """The trainer's softmax cross-entropy before the registry (engine/program.py at e2e0bf4)."""
    b = len(labels)
    p, tmp, picked, ar = np.zeros_like(z), np.zeros((b, 1), dtype), np.zeros(b, dtype), np.arange(b)
    np.max(z, axis=1, keepdims=True, out=tmp)
    np.subtract(z, tmp, out=p)
    np.copyto(picked, p[ar, labels])
    np.exp(p, out=p)
    np.sum(p, axis=1, keepdims=True, out=tmp)
    np.divide(p, tmp, out=p)
    np.log(tmp, out=tmp)
    loss = (float(tmp.sum()) - float(picked.sum())) / b
    d = p.copy()
    d[ar, labels] -= 1
    np.multiply(d, np.dtype(dtype).type(1.0 / b), out=d)
    return loss, d


def test_the_presets_sparse_entry_is_the_old_fused_path_bit_for_bit(rng):
    spec = KM.load("cnn").loss
    loss = LS.Loss(spec, 64, 10)
    for _ in range(3):
        z = rng.normal(0, 3, (64, 10)).astype(np.float32)
        y = rng.integers(0, 10, 64)
        np.copyto(loss.labels, y)
        want, want_grad = _old_fused_softmax_ce(z, y)
        assert loss.step(z) == want
        np.testing.assert_array_equal(loss.grad, want_grad)


@pytest.mark.parametrize(
    "doc",
    [
        None,
        {"class_name": "SparseCategoricalCrossentropy", "config": {"ignore_class": 0}},
        {"class_name": "CategoricalCrossentropy", "config": {"label_smoothing": 0.1}},
        "binary_crossentropy",
        "huber",
    ],
)
def test_the_memory_plan_counts_what_the_loss_allocates(doc):
    spec = LSP.DEFAULT if doc is None else LSP.parse(doc)
    spec = LSP.fold(spec, "sigmoid" if spec.kind == "binary" else "softmax")
    loss = LS.Loss(spec, 8, 3)
    arrays = [
        v
        for k, v in vars(loss).items()
        if isinstance(v, np.ndarray) and k != "arange" and v.base is None  # views own nothing
    ]
    labels, work = LS.buffer_bytes(spec, 8, 3)
    assert labels == loss.labels.nbytes
    assert work == sum(a.nbytes for a in arrays) - labels
