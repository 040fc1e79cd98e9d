"""The export writers against the real thing: Keras 3 (TensorFlow backend) and onnxruntime.

Every supported layer appears in a model built by Keras itself with random weights (and
non-trivial BatchNormalization statistics); ``write_keras`` must give a file that
``keras.saving.load_model`` opens and that predicts what the original predicts, ``write_onnx``
a model that passes ``onnx.checker`` and that onnxruntime runs with the same outputs, and
``read_keras`` must read back Keras' own files. TensorFlow takes ~10 s to import, so all tests
that need it live in this one module.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)

import keras  # noqa: E402  (never skipped: the issue requires these comparisons)
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ringtrain.errors import InvalidSpec  # noqa: E402
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState  # noqa: E402
from ringtrain_trainer.data.dataset import Position  # noqa: E402
from ringtrain_trainer.export import cli as export_cli  # noqa: E402
from ringtrain_trainer.export import read_keras, write_keras, write_onnx  # noqa: E402
from ringtrain_trainer.keras import load as keras_load  # noqa: E402

L = keras.layers


def _models() -> dict[str, keras.Model]:
    """Models that together use every supported layer and argument."""
    return {
        "seeds_cnn": [
            L.Input((28, 28, 1)),
            L.Conv2D(32, 3, activation="relu"),
            L.MaxPooling2D(2),
            L.Flatten(),
            L.Dense(64, activation="relu"),
            L.Dense(10, activation="softmax"),
        ],
        "everything": [
            L.Input((17, 15, 3)),
            L.Rescaling(1 / 255.0, offset=-0.5),
            L.Conv2D(8, (3, 2), strides=2, padding="same", activation="tanh"),
            L.BatchNormalization(epsilon=1e-2),
            L.Conv2D(6, 3, padding="same", use_bias=False),
            L.ReLU(),
            L.AveragePooling2D(pool_size=3, strides=2, padding="same"),
            L.Conv2D(5, 2, strides=(1, 2), activation="sigmoid"),
            L.MaxPooling2D(pool_size=(2, 3), strides=1, padding="same"),
            L.Dropout(0.3),
            L.Flatten(),
            L.Dense(12),
            L.BatchNormalization(center=False),
            L.Activation("relu"),
            L.Reshape((3, 4)),
            L.Dense(5, activation="linear"),
            L.Reshape((15,)),
            L.Dense(7, use_bias=False),
            L.Softmax(),
        ],
        "gap_keepdims": [
            L.Input((9, 9, 2)),
            L.Conv2D(4, 3, padding="same"),
            L.BatchNormalization(scale=False),
            L.AveragePooling2D(2),
            L.GlobalAveragePooling2D(keepdims=True),
            L.Flatten(),
            L.Dense(3, activation="softmax"),
        ],
        "gap_flat_input": [
            L.Input((8, 8)),
            L.Reshape((8, 8, 1)),
            L.Conv2D(3, 3, activation="relu"),
            L.GlobalAveragePooling2D(),
            L.Dense(4),
        ],
    }


def _randomized(model, rng) -> list[np.ndarray]:
    """Random weights everywhere; BatchNormalization's moving variance (its last) positive."""
    for layer in model.layers:
        new = [rng.normal(0, 0.5, w.shape).astype(np.float32) for w in layer.get_weights()]
        if isinstance(layer, L.BatchNormalization):
            new[-1] = rng.uniform(0.2, 2, new[-1].shape).astype(np.float32)
        layer.set_weights(new)
    return model.get_weights()


@pytest.fixture(scope="module")
def models():
    rng = np.random.default_rng(7)
    out = {}
    for name, layers in _models().items():
        m = keras.Sequential(layers, name=name)
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        weights = _randomized(m, rng)
        shape = m.input_shape[1:]
        x = rng.uniform(0, 255 if name == "everything" else 1, (20, *shape)).astype(np.float32)
        out[name] = (m, json.loads(m.to_json()), weights, x)
    return out


def _layers(cfg: dict) -> list:
    """The layer configs without Keras' per-process ``shared_object_id`` markers."""

    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k != "shared_object_id"}
        return [strip(x) for x in v] if isinstance(v, list) else v

    return strip(cfg["config"]["layers"])


def _close(a: np.ndarray, b: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(b).max()))
    assert np.abs(a - b).max() <= 1e-4 * scale
    if b.ndim == 2 and b.shape[1] > 1:
        assert (a.argmax(1) == b.argmax(1)).all()


@pytest.mark.parametrize("name", list(_models()))
def test_keras_load_model_predicts_what_the_source_model_predicts(models, name, tmp_path):
    m, cfg, weights, x = models[name]
    path = write_keras(tmp_path / "m.keras", cfg, weights)
    loaded = keras.saving.load_model(path)
    _close(loaded.predict(x, verbose=0), m.predict(x, verbose=0))
    assert [w.shape for w in loaded.get_weights()] == [w.shape for w in weights]
    assert loaded.loss == "sparse_categorical_crossentropy"  # compile_config carried over


@pytest.mark.parametrize("name", list(_models()))
def test_onnxruntime_runs_what_keras_predicts(models, name, tmp_path):
    m, cfg, weights, x = models[name]
    path = write_onnx(tmp_path / "m.onnx", cfg, weights)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input": x})
    _close(got, m.predict(x, verbose=0))


@pytest.mark.parametrize("name", list(_models()))
def test_read_keras_reads_the_file_keras_wrote(models, name, tmp_path):
    m, cfg, weights, _ = models[name]
    m.save(tmp_path / "k.keras")
    got_cfg, got = read_keras(tmp_path / "k.keras")
    assert _layers(got_cfg) == _layers(cfg)
    assert len(got) == len(weights)
    for a, b in zip(got, weights, strict=True):
        np.testing.assert_array_equal(a, b)


def test_written_archive_has_keras_layout(models, tmp_path):
    _, cfg, weights, _ = models["everything"]
    path = write_keras(tmp_path / "m.keras", cfg, weights)
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["config.json", "metadata.json", "model.weights.h5"]
        meta = json.loads(zf.read("metadata.json"))
    assert set(meta) == {"keras_version", "date_saved"}
    back_cfg, back = read_keras(path)
    assert _layers(back_cfg) == _layers(cfg)
    for a, b in zip(back, weights, strict=True):
        np.testing.assert_array_equal(a, b)


def test_unsupported_layer_is_refused_naming_layer_and_class(tmp_path):
    m = keras.Sequential([L.Input((3, 4, 4, 1)), L.ConvLSTM2D(2, 3, name="grow")])
    cfg = json.loads(m.to_json())
    for write in (write_keras, write_onnx):
        with pytest.raises(InvalidSpec, match=r"layer 'grow' \(ConvLSTM2D\) is not supported"):
            write(tmp_path / "x", cfg, m.get_weights())
    assert not (tmp_path / "x").exists()


def test_unsupported_argument_is_refused_naming_it(tmp_path):
    m = keras.Sequential(
        [
            L.Input((8, 8, 1)),
            L.Conv2D(2, 3, kernel_regularizer=keras.regularizers.OrthogonalRegularizer(), name="w"),
        ]
    )
    with pytest.raises(InvalidSpec, match=r"layer 'w' \(Conv2D\): kernel_regularizer="):
        write_onnx(tmp_path / "x.onnx", json.loads(m.to_json()), m.get_weights())


def test_wrong_weights_are_refused_naming_the_layer(models, tmp_path):
    _, cfg, weights, _ = models["seeds_cnn"]
    with pytest.raises(InvalidSpec, match=r"layer 'dense\w*' \(Dense\): weight 0 has shape"):
        write_keras(tmp_path / "m.keras", cfg, [*weights[:2], weights[2].T, *weights[3:]])
    with pytest.raises(InvalidSpec, match="6 weight arrays but 5 were given"):
        write_keras(tmp_path / "m.keras", cfg, weights[:5])


@pytest.mark.parametrize("model", ["cnn", "cnn2"])
def test_export_command_writes_what_ringtrain_predicts(model, tmp_path, capsys):
    """A checkpoint of a preset → .keras and .onnx that predict what ringtrain's forward does."""
    from ringtrain_trainer.engine import model as model_mod

    spec = keras_load.build(model)
    params = spec.init(seed=3)
    params += np.random.default_rng(3).normal(0, 0.05, params.shape).astype(np.float32)
    CheckpointManager(tmp_path / "ck").save(
        TrainingState(
            step=5, position=Position(0, 5, 64), params=params, optimizer="adam", model=model
        )
    )
    x = np.random.default_rng(4).uniform(0, 1, (16, 28, 28, 1)).astype(np.float32)
    prog = model_mod.Program(spec, 16, train=False)
    np.copyto(prog.x, x)
    expected = prog.forward(spec.views(params)).copy()
    x = x.reshape((16, *spec.config.input_shape))  # what the Keras model takes (28×28 for cnn)

    assert export_cli.main([str(tmp_path / "ck"), "-o", str(tmp_path / "m.keras")]) == 0
    assert "m.keras" in capsys.readouterr().out
    got = keras.saving.load_model(tmp_path / "m.keras").predict(x, verbose=0)
    _close(got, expected)

    manifest = sorted((tmp_path / "ck").glob("ckpt-*.json"))[-1]
    assert export_cli.main([str(manifest), "-o", str(tmp_path / "m.onnx"), "--format", "onnx"]) == 0
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    _close(sess.run(None, {"input": x})[0], expected)


def test_export_uses_the_newest_good_checkpoint_and_names_bad_input(tmp_path, capsys):

    spec = keras_load.build("cnn")
    ck = CheckpointManager(tmp_path / "ck")
    for step in (1, 2):
        ck.save(
            TrainingState(
                step=step,
                position=Position(0, step, 64),
                params=spec.init(seed=step),
                optimizer="sgd",
                model="cnn",
            )
        )
    (tmp_path / "ck" / "ckpt-0000000002.npz").write_bytes(b"torn")
    assert export_cli.main([str(tmp_path / "ck"), "-o", str(tmp_path / "m.keras")]) == 0
    out, err = capsys.readouterr()
    assert "step 1" in out and "skipping corrupt checkpoint" in err and "checksum" in err
    _, weights = read_keras(tmp_path / "m.keras")
    assert sum(w.size for w in weights) == spec.num_params
    np.testing.assert_array_equal(weights[0], spec.views(spec.init(seed=1))[0]["kernel"])

    (tmp_path / "empty").mkdir()
    assert export_cli.main([str(tmp_path / "empty"), "-o", str(tmp_path / "x.keras")]) == 2
    assert "no checkpoint in this directory" in capsys.readouterr().err
    assert export_cli.main([str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "nope.json: manifest does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.keras").exists() and not (tmp_path / "x.onnx").exists()


def test_a_mixed_float16_model_is_exported_under_its_dtype_policies(tmp_path, mnist5k):
    """Trained by ringtrain in fp16, the export keeps each layer's policy (the float32
    softmax too), float32 master weights and the LossScaleOptimizer, and predicts what
    ringtrain's forward does within fp16 rounding; ONNX of the same run stays float32."""
    from support.reference import single_worker_run

    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.engine import model as model_mod

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        src = keras.Sequential(
            [
                keras.Input((28, 28)),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )
        src.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), 1024.0, 7),
            loss="sparse_categorical_crossentropy",
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (tmp_path / "m.json").write_text(src.to_json())
    argv = ["--model", str(tmp_path / "m.json"), "--steps", "2", "--eval-every", "0"]
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), "--export", str(tmp_path / "out.keras")]
    t = single_worker_run(TrainerConfig.from_args(argv, {}), mnist5k)
    assert t.numerics.precision == "fp16"

    got = keras.saving.load_model(tmp_path / "out.keras")
    want = [layer.dtype_policy.name for layer in src.layers]
    assert [layer.dtype_policy.name for layer in got.layers] == want
    assert want == ["mixed_float16", "mixed_float16", "mixed_float16", "float32"]
    assert all(w.dtype == "float32" for w in got.weights)
    assert isinstance(got.optimizer, keras.optimizers.LossScaleOptimizer)
    assert got.optimizer.initial_scale == 1024.0 and got.optimizer.dynamic_growth_steps == 7

    x = np.random.default_rng(4).uniform(0, 1, (16, 28, 28)).astype(np.float32)
    prog = model_mod.Program(t.spec, 16, train=False)
    np.copyto(prog.x, x.reshape(prog.x.shape))
    logits = prog.forward(t.spec.views(t.params)).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got.predict(x, verbose=0), e / e.sum(1, keepdims=True), atol=1e-2)

    state = CheckpointManager(tmp_path / "ck").load_latest()[0]
    path = export_cli.export_state(state, tmp_path / "m.onnx", "onnx", "fp16")
    graph = onnx.load(str(path)).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_a_float32_model_trained_with_precision_fp16_exports_as_mixed_float16(tmp_path, mnist5k):
    """``--precision fp16`` on a preset: the checkpoint records the precision, so
    ``ringtrain export`` gives every layer mixed_float16, predicting what ringtrain does."""
    from support.reference import single_worker_run

    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.engine import model as model_mod

    argv = ["--model", "cnn", "--steps", "2", "--eval-every", "0", "--precision", "fp16"]
    argv += ["--checkpoint-dir", str(tmp_path / "ck")]
    t = single_worker_run(TrainerConfig.from_args(argv, {}), mnist5k)
    assert export_cli.main([str(tmp_path / "ck"), "-o", str(tmp_path / "m.keras")]) == 0
    got = keras.saving.load_model(tmp_path / "m.keras")
    assert {layer.dtype_policy.name for layer in got.layers} == {"mixed_float16"}
    x = np.random.default_rng(5).uniform(0, 1, (8, 28, 28, 1)).astype(np.float32)
    prog = model_mod.Program(t.spec, 8, train=False)
    np.copyto(prog.x, x)
    want = prog.forward(t.spec.views(t.params)).copy()
    got_y = got.predict(x.reshape((8, *t.spec.config.input_shape)), verbose=0)
    np.testing.assert_allclose(got_y, want, atol=2e-2, rtol=2e-2)


def test_the_export_keeps_the_compiled_metrics_and_keras_evaluates_each(tmp_path):
    """A model compiled with metrics comes back compiled with them: real Keras' ``evaluate``
    reports every one, and the same values as the source model (same weights, same data)."""
    keras.utils.set_random_seed(3)
    km = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(5)]
    )
    km.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3)],
    )
    spec = keras_load.from_config(json.loads(km.to_json()), "metrics")
    path = write_keras(tmp_path / "m.keras", spec.keras_config(), km.get_weights())
    loaded = keras.saving.load_model(path)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 5, 32)
    got = loaded.evaluate(x, y, verbose=0, return_dict=True)
    want = km.evaluate(x, y, verbose=0, return_dict=True)
    assert set(got) == set(want) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy"}
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
