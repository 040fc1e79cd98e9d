"""`.npz` data sets as `np.savez` writes `keras.datasets.*.load_data()`: loading and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringtrain.errors import DataError
from ringtrain_trainer.data import dataset as D
from ringtrain_trainer.data.fit import check_fits
from ringtrain_trainer.data.npz import load_npz, raw_pixels_note
from ringtrain_trainer.worker_main import main as worker_main


def save(
    path, n_train=12, n_test=5, shape=(6, 5), dtype=np.uint8, classes=3, column=False, **override
):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.uniform(0, 255, (n, *shape)).astype(dtype)
        y = (np.arange(n) % classes).astype(np.uint8)
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x, y.reshape(n, 1) if column else y
    arrays.update(override)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return arrays


@pytest.mark.parametrize("shape", [(6, 5), (6, 5, 3)])
def test_uint8_images_of_any_shape_are_fed_as_stored_like_keras_fit(tmp_path, shape):
    """0..255 reach the model (as float32), as ``model.fit(x_uint8)`` feeds them: scaling is
    the model's business (``Rescaling``), never done a second time by the loader."""
    a = save(tmp_path / "d.npz", shape=shape, classes=4, column=True)
    ds = D.load("fashion-mnist", tmp_path / "d.npz")
    assert (ds.name, ds.num_classes, len(ds.train), len(ds.test)) == ("d", 4, 12, 5)
    assert ds.train.images.dtype == np.uint8 and ds.train.labels.dtype == np.int64
    assert ds.train.scale == ds.test.scale == 1.0
    x, y = np.zeros((3, *shape), np.float32), np.zeros(3, np.int64)
    D.batch_into(ds.train, np.array([4, 0, 7]), x, y, np.zeros((3, *shape), np.uint8))
    np.testing.assert_array_equal(x, a["x_train"][[4, 0, 7]].astype(np.float32))
    np.testing.assert_array_equal(y, a["y_train"].ravel()[[4, 0, 7]])
    np.testing.assert_array_equal(ds.test.inputs(1, 3), a["x_test"][1:3].astype(np.float32))


def test_float_images_are_used_as_they_are(tmp_path):
    a = save(tmp_path / "f.npz", dtype=np.float64, shape=(4, 4, 2))
    ds = load_npz(tmp_path / "f.npz")
    assert ds.train.images.dtype == np.float32
    x, y = np.zeros((2, 4, 4, 2), np.float32), np.zeros(2, np.int64)
    D.batch_into(ds.train, np.array([3, 1]), x, y, np.zeros((2, 4, 4, 2), np.uint8))
    np.testing.assert_array_equal(x, a["x_train"][[3, 1]].astype(np.float32))


@pytest.mark.parametrize(
    "override, problem",
    [
        ({"y_test": None}, r"missing y_test \(has x_train, y_train, x_test; needs"),
        ({"y_train": np.zeros(11, np.uint8)}, "x_train has 12 examples but y_train has 11 labels"),
        ({"x_test": np.zeros((5, 6, 4), np.uint8)}, r"x_train examples are \(6, 5\) but x_test"),
        ({"x_train": np.full((12, 6, 5), 2**25, np.int64)}, r"x_train \(int64, shape \(12, 6, 5"),
        ({"x_train": np.zeros((12, 6, 5), np.bool_)}, "dtype bool; expected uint8, integer"),
        ({"y_train": np.zeros((12, 3), np.uint8)}, r"y_train labels are float32 \(3,\) per"),
        ({"y_train": np.zeros(12, np.float32)}, r"y_train labels are float32 \(1,\) per"),
        ({"y_train": np.zeros((12, 2, 2), np.float32)}, r"y_train labels are float32 \(2, 2\) per"),
        ({"y_train": np.full(12, np.nan, np.float32)}, "y_train has a NaN"),
        ({"y_train": np.full(12, -1, np.int64)}, "negative label -1"),
        (
            {"x_test": np.zeros((0, 6, 5), np.uint8), "y_test": np.zeros(0, np.uint8)},
            "x_test is empty",
        ),
    ],
)
def test_bad_npz_is_refused_naming_the_file(tmp_path, override, problem):
    p = tmp_path / "bad.npz"
    save(p, **override)
    with pytest.raises(DataError, match=problem) as e:
        load_npz(p)
    assert str(p) in str(e.value)


def test_missing_corrupt_and_non_npz_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_npz(tmp_path / "nope.npz")
    good = tmp_path / "good.npz"
    save(good)
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:200])
    (tmp_path / "text.npz").write_text("hello")
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    for name, problem in (
        ("cut", "not a readable .npz"),
        ("text", "not a readable .npz"),
        ("one", "a single .npy array"),
    ):
        with pytest.raises(DataError, match=problem) as e:
            load_npz(tmp_path / f"{name}.npz")
        assert f"{name}.npz" in str(e.value)


def test_check_fits_compares_shapes_and_labels_with_the_model(tmp_path):
    save(tmp_path / "d.npz", shape=(28, 28), classes=10)
    ds = load_npz(tmp_path / "d.npz")
    check_fits(ds, (28, 28, 1), 10, tmp_path / "d.npz")
    with pytest.raises(
        DataError,
        match=r"d.npz: x_train is uint8 \(12, 28, 28\), examples of \(28, 28\), but the "
        r"model's input takes \(batch, 32, 32, 3\)",
    ):
        check_fits(ds, (32, 32, 3), 10, tmp_path / "d.npz")
    with pytest.raises(
        DataError, match=r"d.npz: y_train: label 9 is outside the model's 5 classes"
    ):
        check_fits(ds, (28, 28, 1), 5, tmp_path / "d.npz")


def test_worker_trains_on_a_npz_via_data_and_data_dir(tmp_path, capsys):
    p = tmp_path / "mine.npz"
    save(p, n_train=64, n_test=16, shape=(28, 28), classes=10)
    for flag in ("--data", "--data-dir"):
        assert (
            worker_main(
                [
                    flag,
                    str(p),
                    "--steps",
                    "2",
                    "--batch-size",
                    "16",
                    "--json",
                    "--termination-log",
                    str(tmp_path / "log"),
                ]
            )
            == 0
        )
        final = json.loads((tmp_path / "log").read_text())
        assert (final["steps"], final["terminated"]) == (2, False)
        assert final["test_accuracy"] is not None and np.isfinite(final["loss"])
        # uint8 pixels into the cnn preset (no Rescaling): trained as 0..255, and told so
        assert "mine.npz: uint8 pixels are fed to the model as stored" in capsys.readouterr().err


def test_the_raw_pixels_note_is_only_for_uint8_into_a_model_without_rescaling(tmp_path):
    from ringtrain_trainer.keras import load as KM

    save(tmp_path / "u.npz", shape=(28, 28))
    save(tmp_path / "f.npz", shape=(28, 28), dtype=np.float32)
    u8, f32 = load_npz(tmp_path / "u.npz"), load_npz(tmp_path / "f.npz")
    cfg = KM.preset_config("cnn")
    layers = cfg["config"]["layers"]
    scaled = {"class_name": "Rescaling", "config": {"name": "s", "scale": 1 / 255}}
    with_rescaling = KM.from_config(
        {**cfg, "config": {**cfg["config"], "layers": [*layers[:2], scaled, *layers[2:]]}}
    )
    assert "Rescaling(1/255)" in raw_pixels_note(u8, KM.load("cnn"), "u.npz")
    assert raw_pixels_note(u8, with_rescaling, "u.npz") is None
    assert raw_pixels_note(f32, KM.load("cnn"), "f.npz") is None
    assert raw_pixels_note(D.load_mnist5k(), KM.load("cnn"), "mnist-5k") is None


def test_worker_refuses_data_the_model_cannot_take(tmp_path, capsys):
    p = tmp_path / "cifar.npz"
    save(p, n_train=32, n_test=8, shape=(32, 32, 3))
    assert (
        worker_main(["--data", str(p), "--steps", "1", "--termination-log", str(tmp_path / "log")])
        == 2
    )
    err = capsys.readouterr().err
    assert f"{p}: x_train is uint8 (32, 32, 32, 3), examples of (32, 32, 3), but the" in err


def _loss(name: str, act: str | None = None):
    from ringtrain_trainer.engine import loss_spec as LSP

    return LSP.fold(LSP.parse(name), act)


def test_tables_token_ids_and_every_label_form_load_and_conform_to_the_loss(tmp_path):
    """2-D tables, int token ids, and the labels each loss reads as Keras' ``fit`` takes them:
    0/1 ints ``(n,)`` for a one-output binary model, float class ids ``(n, 1)`` for sparse
    cross-entropy, float targets ``(n,)`` for a one-output regression."""
    from ringtrain_trainer.data.fit import conform

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (20, 7)).astype(np.int32)
    save(tmp_path / "t.npz", x_train=ids[:12], x_test=ids[12:17])
    ds = load_npz(tmp_path / "t.npz")
    assert ds.train.images.dtype == np.int32
    x = np.zeros((3, 7), np.float32)
    scratch = np.zeros((3, 7), np.int32)
    D.batch_into(ds.train, np.array([2, 0, 5]), x, np.zeros(3, np.int64), scratch)
    np.testing.assert_array_equal(x, ids[[2, 0, 5]].astype(np.float32))
    check_fits(ds, (7,), 3, "t.npz", _loss("sparse_categorical_crossentropy", "softmax"), "int32")

    table = rng.normal(0, 1, (17, 4))
    bits = (np.arange(17) % 2).astype(np.int64)
    save(tmp_path / "b.npz", x_train=table[:12], x_test=table[12:], y_train=bits[:12],
         y_test=bits[12:])  # fmt: skip
    binary = _loss("binary_crossentropy", "sigmoid")
    ds = conform(load_npz(tmp_path / "b.npz"), binary, 1)
    assert ds.train.labels.shape == (12, 1) and ds.train.labels.dtype == np.float32
    check_fits(ds, (4,), 1, "b.npz", binary)
    with pytest.raises(DataError, match=r"b.npz: y_train \(int64 \(12,\)\) has integer class ids"):
        check_fits(conform(load_npz(tmp_path / "b.npz"), binary, 2), (4,), 2, "b.npz", binary)
    with pytest.raises(
        DataError,
        match=r"b.npz: x_train is float32 \(12, 4\), examples of \(4,\), but the model's "
        r"input takes \(batch, 5\)",
    ):
        check_fits(ds, (5,), 1, "b.npz", binary)
    with pytest.raises(DataError, match=r"x_train is float32 \(12, 4\) with fractional values"):
        check_fits(ds, (4,), 1, "b.npz", binary, "int32")

    floats = (np.arange(17) % 3).astype(np.float32).reshape(17, 1)
    save(tmp_path / "f.npz", y_train=floats[:12], y_test=floats[12:])
    sparse = _loss("sparse_categorical_crossentropy", "softmax")
    ds = conform(load_npz(tmp_path / "f.npz"), sparse, 3)
    np.testing.assert_array_equal(ds.train.labels, np.arange(12) % 3)
    assert ds.train.labels.dtype == np.int64

    targets = rng.normal(0, 1, 17).astype(np.float32)
    save(tmp_path / "r.npz", x_train=table[:12], x_test=table[12:], y_train=targets[:12],
         y_test=targets[12:])  # fmt: skip
    mse = _loss("mse")
    ds = conform(load_npz(tmp_path / "r.npz"), mse, 1)
    check_fits(ds, (4,), 1, "r.npz", mse)
    with pytest.raises(DataError, match=r"r.npz: y_train \(float32 \(12, 1\)\) has rows of 1; "):
        check_fits(ds, (4,), 2, "r.npz", mse)
