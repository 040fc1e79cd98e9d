"""Functional Keras models with several inputs and several outputs, trained by ringtrain and by
Keras from the same ``.keras`` starting weights on the same batches: the same total loss and
the same loss per output at every step, the same predictions for every output after, and an
export that Keras reloads predicting the same.

The data file names its arrays per input and output (``x_train_<input>``,
``y_train_<output>``: ``data_multi``). Imports TensorFlow (slow): one module for all of it.
"""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import DataError, InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers
STEPS, BATCH, N = 5, 8, 48
#: float32 arithmetic in two orders (numpy vs TensorFlow): relative tolerance per step
RTOL = 1e-4


def two_in_two_out():
    """A table and a small image, joined; a softmax classifier and a regression head."""
    keras.utils.set_random_seed(3)
    tab = L.Input((6,), name="tab")
    img = L.Input((4, 4, 1), name="img")
    a = L.Dense(5, activation="relu", name="ta")(tab)
    b = L.Conv2D(2, 3, activation="relu", name="ic")(img)
    b = L.Flatten(name="fl")(b)
    h = L.Concatenate(name="cat")([a, b])
    cls = L.Dense(3, activation="softmax", name="cls")(h)
    reg = L.Dense(2, name="reg")(h)
    return keras.Model([tab, img], [cls, reg])


def _data(rng):
    return {
        "tab": rng.random((N, 6)).astype(np.float32),
        "img": rng.random((N, 4, 4, 1)).astype(np.float32),
        "cls": rng.integers(0, 3, N),
        "reg": rng.normal(size=(N, 2)).astype(np.float32),
    }


def _save(path, d, names=("tab", "img", "cls", "reg")):
    arrays = {}
    for k in names:
        kind = "x" if k in ("tab", "img") else "y"
        arrays[f"{kind}_train_{k}"] = d[k][:32]
        arrays[f"{kind}_test_{k}"] = d[k][32:]
    np.savez(path, **arrays)


def _trainer(tmp_path, extra=()):
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--ipu-host-threads", "1"]
    args += ["--json", "--checkpoint-dir", str(tmp_path / "ck"), *extra]
    return Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())


def _parts(t) -> np.ndarray:
    progs = t.exe.programs
    return np.mean([p.loss.parts for p in progs], axis=0)


DICT = {"cls": "sparse_categorical_crossentropy", "reg": "mse"}
RECOMPUTE = ("--allow-recompute", "--recomputation-checkpoints", "cat")


@pytest.mark.parametrize(
    "loss,weights,extra",
    [
        (DICT, {"cls": 1.0, "reg": 0.5}, ()),
        (["sparse_categorical_crossentropy", "huber"], [0.3, 2.0], ()),
        (["sparse_categorical_crossentropy", None], None, ()),
        (DICT, [2.0, 1.0], RECOMPUTE),
    ],
    ids=["dict", "list", "none", "recompute"],
)
def test_two_inputs_two_outputs_train_like_keras_per_output(loss, weights, extra, tmp_path):
    km = two_in_two_out()
    metrics = {"cls": ["accuracy"], "reg": ["mae"]} if isinstance(loss, dict) else None
    km.compile(keras.optimizers.SGD(0.1), loss=loss, loss_weights=weights, metrics=metrics)
    km.save(tmp_path / "m.keras")
    d = _data(np.random.default_rng(0))
    trained = ["cls", "reg"] if (loss[1] if isinstance(loss, list) else True) else ["cls"]
    _save(tmp_path / "d.npz", d, ("tab", "img", *trained))
    t = _trainer(tmp_path, extra)
    try:
        assert len(t.spec.graph.inputs) == 2 and len(t.spec.graph.outputs) == 2
        for _ in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss_, _, _ = t.train_one_step()
            want = km.train_on_batch(
                {k: d[k][idx] for k in ("tab", "img")},
                {k: d[k][idx] for k in ("cls", "reg")},
                return_dict=True,
            )
            assert loss_ == pytest.approx(float(want["loss"]), rel=RTOL)
            mine = t.spec.loss.named(_parts(t))
            assert {f"{n}_loss" for n in trained} <= set(mine)
            for k, v in mine.items():
                if k in want:  # Keras logs <output>_loss for every output with a loss
                    assert v == pytest.approx(float(want[k]), rel=RTOL, abs=1e-6), k
            if metrics:  # and each output's metric on this batch
                assert {"cls_accuracy", "reg_mae"} <= set(mine) <= set(want)
        prog = M.Program(t.spec, 16, False, state=t.ipu.state)
        prog.x[:] = np.concatenate([d["tab"][32:], d["img"][32:].reshape(16, -1)], axis=1)
        prog.forward(t.spec.views(t.params))
        got = [prog.tensors[o].copy() for o in t.spec.graph.outputs]
        want_cls, want_reg = km.predict([d["tab"][32:], d["img"][32:]], verbose=0)
        p = np.exp(got[0] - got[0].max(1, keepdims=True))
        np.testing.assert_allclose(p / p.sum(1, keepdims=True), want_cls, atol=2e-5)
        np.testing.assert_allclose(got[1], want_reg, atol=2e-5)
        config = t.spec.keras_config()
        weights_ = t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    if extra:
        assert all(p.recomputed > 0 for p in t.exe.programs)
    path = write_keras(tmp_path / "out.keras", config, weights_)
    back = keras.saving.load_model(path)
    assert back.output_names == ["cls", "reg"]
    b_cls, b_reg = back.predict({"tab": d["tab"][32:], "img": d["img"][32:]}, verbose=0)
    np.testing.assert_allclose(b_cls, want_cls, atol=2e-5)
    np.testing.assert_allclose(b_reg, want_reg, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights_)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["tab", "img"]
    o_cls, o_reg = sess.run(["cls", "reg"], {"tab": d["tab"][32:], "img": d["img"][32:]})
    np.testing.assert_allclose(o_cls, want_cls, atol=2e-5)
    np.testing.assert_allclose(o_reg, want_reg, atol=2e-5)


def _cfg(km) -> dict:
    return json.loads(km.to_json()) | {"compile_config": km.get_compile_config()}


def test_compile_settings_per_output_are_read_or_refused_naming_the_output():
    km = two_in_two_out()
    km.compile("sgd", loss="mse")  # one loss for all outputs
    cfg = parse(_cfg(km))
    assert [h.loss.name for h in cfg.loss.heads] == ["MeanSquaredError"] * 2
    assert [i.name for i in cfg.inputs] == ["tab", "img"] and cfg.output_names == ("cls", "reg")
    km.compile("sgd", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
               loss_weights={"reg": 0.25})  # fmt: skip
    cfg = parse(_cfg(km))
    assert [h.weight for h in cfg.loss.heads] == [1.0, 0.25]
    assert cfg.loss.heads[0].loss.folded == "softmax"
    bad = _cfg(km)
    bad["compile_config"]["loss_weights"] = {"nope": 1.0}
    with pytest.raises(InvalidSpec, match=r"'nope'.*outputs: cls, reg"):
        parse(bad)
    bad["compile_config"]["loss_weights"] = None
    bad["compile_config"]["metrics"] = {"reg": ["accuracy"]}
    with pytest.raises(InvalidSpec, match="metric 'accuracy' for output 'reg'"):
        parse(bad)
    keyed = _cfg(km)
    keyed["config"]["output_layers"] = {"y": ["cls", 0, 0], "z": ["reg", 0, 0]}
    with pytest.raises(InvalidSpec, match="output_layers as a dict"):
        parse(keyed)
    bad["compile_config"]["metrics"] = None
    bad["compile_config"]["loss"] = [None, None]
    with pytest.raises(InvalidSpec, match="None for every output"):
        parse(bad)


def test_data_named_per_input_and_output_is_checked_naming_the_input(tmp_path):
    km = two_in_two_out()
    km.compile(keras.optimizers.SGD(0.1), loss=["sparse_categorical_crossentropy", "mse"])
    km.save(tmp_path / "m.keras")
    d = _data(np.random.default_rng(1))
    d["img"] = d["img"][:, :3]  # the wrong shape for input 'img'
    _save(tmp_path / "d.npz", d)
    with pytest.raises(DataError, match="input 'img'"):
        _trainer(tmp_path)
    d = _data(np.random.default_rng(1))
    _save(tmp_path / "d.npz", d, ("tab", "img", "cls"))
    with pytest.raises(DataError, match="y_train_reg for the model's output 'reg'"):
        _trainer(tmp_path)
    arrays = {f"x_train_{k}": d[k][:32] for k in ("tab", "img")}
    np.savez(tmp_path / "d.npz", **arrays, x_test_tab=d["tab"], x_test_img=d["img"],
             y_train_cls=d["cls"][:32], y_test_cls=d["cls"], y_train_reg=d["reg"][:32],
             y_test_reg=d["reg"], x_train_extra=d["tab"][:32])  # fmt: skip
    with pytest.raises(DataError, match="x_train_extra name no input or output"):
        _trainer(tmp_path)


def test_token_ids_and_a_table_in_binary_and_one_hot_outputs_train_like_keras(tmp_path):
    """An int32 token input (Embedding) beside a float one; a sigmoid and a one-hot softmax
    output, compiled with Adam and a list of losses: each output's loss as Keras'."""
    keras.utils.set_random_seed(5)
    words = L.Input((6,), dtype="int32", name="words")
    num = L.Input((3,), name="num")
    e = L.GlobalAveragePooling1D(name="avg")(L.Embedding(20, 4, name="emb")(words))
    h = L.Concatenate(name="cat")([e, L.Dense(4, activation="relu", name="dn")(num)])
    spam = L.Dense(1, activation="sigmoid", name="spam")(h)
    topic = L.Dense(3, activation="softmax", name="topic")(h)
    km = keras.Model([words, num], [spam, topic])
    km.compile(
        keras.optimizers.Adam(0.01),
        loss=["binary_crossentropy", "categorical_crossentropy"],
        metrics=[["accuracy"], ["accuracy"]],
    )
    km.save(tmp_path / "m.keras")
    rng = np.random.default_rng(2)
    d = {
        "words": rng.integers(0, 20, (N, 6)).astype(np.int32),
        "num": rng.random((N, 3)).astype(np.float32),
        "spam": rng.integers(0, 2, (N, 1)).astype(np.float32),
        "topic": np.eye(3, dtype=np.float32)[rng.integers(0, 3, N)],
    }
    arrays = {}
    for k, v in d.items():
        kind = "x" if k in ("words", "num") else "y"
        arrays[f"{kind}_train_{k}"], arrays[f"{kind}_test_{k}"] = v[:32], v[32:]
    np.savez(tmp_path / "d.npz", **arrays)
    t = _trainer(tmp_path)
    try:
        for _ in range(STEPS):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss_, _, _ = t.train_one_step()
            want = km.train_on_batch(
                [d["words"][idx], d["num"][idx]], [d["spam"][idx], d["topic"][idx]],
                return_dict=True,
            )  # fmt: skip
            assert loss_ == pytest.approx(float(want["loss"]), rel=RTOL)
            got = t.spec.loss.named(_parts(t))
            assert got["spam_loss"] == pytest.approx(float(want["spam_loss"]), rel=RTOL)
            assert got["topic_loss"] == pytest.approx(float(want["topic_loss"]), rel=RTOL)
        t.evaluate()
        assert set(t.test_outputs) == {"spam_loss", "spam_accuracy", "topic_loss", "topic_accuracy"}
        logs = km.evaluate(
            [d["words"][32:], d["num"][32:]], [d["spam"][32:], d["topic"][32:]],
            verbose=0, return_dict=True,
        )  # fmt: skip
        for k in ("spam_loss", "spam_accuracy", "topic_loss", "topic_accuracy"):
            assert t.test_outputs[k] == pytest.approx(float(logs[k]), rel=1e-4, abs=1e-6), k
    finally:
        t.close()
