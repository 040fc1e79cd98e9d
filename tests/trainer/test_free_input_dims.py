"""Variable-length inputs (``keras.Input(shape=(None,))``, ``(None, features)``): the worker
compiles the static graph the data's ``x`` fixes, trains it as Keras trains the same model on
the same batches, and the export keeps the None dimensions, so Keras and onnxruntime take
another length; data that cannot fill them is refused by name."""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import report
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.export.cli import export_state
from ringtrain_trainer.keras.config import fix_input_shape, free_input_shape
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)
L = keras.layers
SEQ, STEPS = 12, 3


def _text():
    inp = keras.Input(shape=(None,), dtype="int32")
    x = L.Embedding(20, 4)(inp)
    x = L.GRU(5)(x)
    out = L.Dense(1, activation="sigmoid")(x)
    m = keras.Model(inp, out)
    m.compile(keras.optimizers.SGD(0.5), "binary_crossentropy", metrics=["accuracy"])
    return m


def _series():
    m = keras.Sequential(
        [
            keras.Input((None, 3)),
            L.Conv1D(4, 3, padding="same", activation="relu"),
            L.GlobalAveragePooling1D(),
            L.Dense(2),
        ]
    )
    m.compile(keras.optimizers.SGD(0.1), "mse")
    return m


def _data(family, rng, n=48, seq=SEQ):
    if family == "text":
        x = rng.integers(1, 20, (n, seq))
        y = (x[:, :1] % 2).astype(np.float32)
        return x, y
    x = rng.normal(size=(n, seq, 3)).astype(np.float32)
    return x, x.mean(axis=1)[:, :2].astype(np.float32)


def _trainer(path, x, y, out):
    data = Dataset("d", Split(x[:32].astype(np.float32), y[:32]), Split(x[32:], y[32:]), 2)
    args = ["--model", str(path), "--steps", str(STEPS), "--batch-size", "8"]
    args += ["--ipu-host-threads", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stderr", out)
        cfg = TrainerConfig.from_args(args, {})
        return Trainer(cfg, LocalCollective(), data, out=io.StringIO())


@pytest.mark.parametrize("family", ["text", "series"])
def test_trained_as_keras_trains_it_and_exported_with_free_dims(family, tmp_path):
    keras.utils.set_random_seed(2)
    km = _text() if family == "text" else _series()
    km.save(tmp_path / "m.keras")
    rng = np.random.default_rng(3)
    x, y = _data(family, rng)
    log = io.StringIO()
    t = _trainer(tmp_path / "m.keras", x, y, log)
    try:
        assert t.spec.config.input_shape[0] == SEQ
        assert "None dimensions fixed by the data" in log.getvalue()
        for step in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            t.train_one_step()
            km.train_on_batch(x[idx], y[idx])
            got = t.spec.keras_weights(t.params, t.state)
            for w, k in zip(got, km.get_weights(), strict=True):
                np.testing.assert_allclose(w, k, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
        state = t.state(None)
        keras_path = export_state(state, tmp_path / "out.keras", "keras", spec=t.spec)
        onnx_path = export_state(state, tmp_path / "out.onnx", "onnx", spec=t.spec)
    finally:
        t.close()
    other, _ = _data(family, rng, n=5, seq=7)  # another length than the training data's
    want = km.predict(other, verbose=0)
    loaded = keras.saving.load_model(keras_path, compile=False)
    assert loaded.input_shape[1] is None
    np.testing.assert_allclose(loaded.predict(other, verbose=0), want, rtol=1e-4, atol=1e-5)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (onnx_out,) = sess.run(None, {"input": other.astype(np.float32)})
    np.testing.assert_allclose(onnx_out, want, rtol=1e-4, atol=1e-5)


def test_data_that_cannot_fill_the_free_dims_is_refused_by_name(tmp_path):
    model = json.loads(_series().to_json())
    assert free_input_shape(model) == (None, 3)
    assert free_input_shape(fix_input_shape(model, (9, 3))) is None
    assert free_input_shape(model) == (None, 3)  # the model's own config untouched
    for bad in [(9, 4), (9,), (9, 3, 1)]:
        with pytest.raises(InvalidSpec, match=r"input shape \(None, 3\) has free .* \(9"):
            fix_input_shape(model, bad)


def test_a_checkpoint_exports_and_the_operator_validates_without_the_data(tmp_path):
    """No data at hand: the layers are read at any length (their weights do not depend on
    it); the operator accepts the inline config and leaves the memory plan to the worker."""
    from ringtrain_operator import modelcheck
    from ringtrain_operator.spec import model_error

    keras.utils.set_random_seed(2)
    km = _text()
    km.save(tmp_path / "m.keras")
    rng = np.random.default_rng(3)
    x, y = _data("text", rng)
    t = _trainer(tmp_path / "m.keras", x, y, io.StringIO())
    try:
        t.train_one_step()
        state = t.state(None)
        trained = t.spec.keras_weights(t.params, t.state)
    finally:
        t.close()
    path = export_state(state, tmp_path / "ckpt.keras", "keras")  # rebuilt from the checkpoint
    loaded = keras.saving.load_model(path, compile=False)
    for got, want in zip(loaded.get_weights(), trained, strict=True):
        np.testing.assert_array_equal(got, want)
    km.set_weights(trained)
    other, _ = _data("text", rng, n=3, seq=5)
    np.testing.assert_allclose(loaded.predict(other, verbose=0), km.predict(other, verbose=0))
    inline = json.loads(km.to_json())
    assert model_error(inline, (1 << 20, 8)) is None
    # the operator leaves its IPUs unplanned (counted at capacity): the data fixes the length
    assert modelcheck.plan(inline, 8, 1 << 20, None, True)[0] is None
    assert modelcheck.plan(json.dumps(inline), 8, 1 << 20, None, True)[0] is None


def test_the_memory_report_plans_the_data_s_length_and_says_so(tmp_path):

    keras.utils.set_random_seed(2)
    _series().save(tmp_path / "m.keras")
    x, y = _data("series", np.random.default_rng(1), n=16, seq=9)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    args = ["--model", str(tmp_path / "m.keras"), "--data-dir", str(tmp_path / "d.npz")]
    out = io.StringIO()
    report.report(TrainerConfig.from_args([*args, "--batch-size", "8"], {}), out)
    assert "input (None, 3) fixed to (9, 3) by the data's x" in out.getvalue()
