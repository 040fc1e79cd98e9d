"""Nested models, shared layers and frozen layers against real Keras 3 (same ``.keras`` start,
same batches).

Transfer learning as users write it: a small MobileNetV2-like base (``include_top=False``
style: no classifier) nested in a new model, frozen with a new head, then unfrozen for
fine-tuning; and a ConvNeXt-style block written as a ``keras.Sequential`` inside a Functional
model. ringtrain flattens the nesting into one graph (``keras.nested``), runs frozen layers
with their weights as state (``engine.ops.frozen``; a frozen BatchNormalization in inference
mode, as Keras 3), runs each call of a shared layer as its own op on one set of weights whose
gradients are summed (``engine.ops.shared``), and exports all of it back for Keras.
"""

import io
import json
import os

import numpy as np
import pytest
from support.gradcheck import gradcheck
from support.keras_steps import follows_keras, train_beside_keras
from test_keras_layers import fd_check

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import onnxruntime as ort

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops.batchnorm import BatchNorm
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.frozen import Frozen
from ringtrain_trainer.engine.ops.shared import Shared, Tied
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.keras import budget
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _base():
    """MobileNetV2's first block, no top: conv-BN-ReLU6, depthwise-BN-ReLU6, project-BN."""
    i = L.Input((8, 8, 3))
    h = L.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="conv1")(i)
    h = L.ReLU(6.0, name="relu1")(L.BatchNormalization(name="bn1")(h))
    h = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(h)
    h = L.ReLU(6.0, name="relu2")(L.BatchNormalization(name="bn2")(h))
    h = L.Conv2D(4, 1, use_bias=False, name="project")(h)
    return keras.Model(i, L.BatchNormalization(name="bn3")(h), name="base")


def _transfer(rng):
    base = _base()
    inp = L.Input((8, 8, 3))
    h = L.GlobalAveragePooling2D()(base(inp))
    km = keras.Model(inp, L.Dense(3, activation="softmax", name="head")(h))
    ws = []
    for w in km.weights:  # moving statistics far from a batch's: inference mode shows
        v = rng.normal(0, 0.4, w.shape)
        ws.append(np.abs(v) + 0.5 if "variance" in w.path else v)
    km.set_weights([w.astype(np.float32) for w in ws])
    return km, base


def _convnext():
    inp = L.Input((8, 8, 4))
    x = L.Conv2D(8, 2, strides=2, name="stem")(inp)
    block = keras.Sequential(
        [
            L.DepthwiseConv2D(3, padding="same", name="dwconv"),
            L.LayerNormalization(epsilon=1e-6, name="ln"),
            L.Dense(16, activation="gelu", name="pw1"),
            L.Dense(8, name="pw2"),
        ],
        name="block",
    )
    x = L.Add()([x, block(x)])
    x = L.LayerNormalization(epsilon=1e-6)(L.GlobalAveragePooling2D()(x))
    return keras.Model(inp, L.Dense(3, activation="softmax")(x))


def _trainer(tmp_path, km, x, y, steps, tag):
    km.save(tmp_path / f"{tag}.keras")
    np.savez(tmp_path / "d.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    args = ["--model", str(tmp_path / f"{tag}.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(steps), "--batch-size", "8", "--ipu-host-threads", "1", "--json"]
    args += ["--checkpoint-dir", str(tmp_path / f"ck-{tag}")]
    return Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())


def _steps(t, km, x, y, steps):
    ours, theirs = [], []
    for _ in range(steps):
        pos = t.position
        idx = t.sharder.indices(pos.epoch, pos.batch).copy()
        ours.append(t.train_one_step()[0])
        theirs.append(float(km.train_on_batch(x[idx], y[idx])))
    return ours, theirs


def _predict(t, x):
    prog = M.Program(t.spec, len(x), False, state=t.ipu.state)
    prog.x[:] = x.reshape(prog.x.shape)
    z = prog.forward(t.spec.views(t.params)).astype(np.float64)
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _export(t, tmp_path, x, want, atol):
    config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    path = write_keras(tmp_path / "out.keras", config, weights)
    back = keras.saving.load_model(path)
    np.testing.assert_allclose(back.predict(x, verbose=0), want, atol=atol)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], want, atol=atol)
    return back


def test_a_frozen_nested_base_with_a_new_head_then_fine_tuning_train_like_keras(tmp_path, rng):
    km, base = _transfer(rng)
    x = rng.normal(0.5, 1.0, (48, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 3, 48)
    start = {w.path: w.numpy().copy() for w in km.weights}
    base.trainable = False
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    t = _trainer(tmp_path, km, x, y, 4, "frozen")
    try:
        names = [s.name for s in t.spec.config.layers]
        assert names[:3] == ["base/conv1", "base/bn1", "base/relu1"], names
        frozen = sum(w.numpy().size for w in base.weights if "moving" not in w.path)
        assert t.spec.num_frozen == frozen and t.spec.num_params == 4 * 3 + 3
        assert f"{frozen:,} frozen" in t.training_line()
        ours, theirs = _steps(t, km, x, y, 4)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
        want = km.predict(x[32:], verbose=0)
        np.testing.assert_allclose(_predict(t, x[32:]), want, atol=2e-6)
        got = t.spec.keras_weights(t.params, t.ipu.state)
        mine = dict(zip([w.path for w in km.weights], got, strict=True))
        for w in base.weights:  # untouched: no gradient, no optimizer, no statistics update
            np.testing.assert_array_equal(mine[w.path], start[w.path])
        np.testing.assert_allclose(mine["head/kernel"], km.get_layer("head").kernel, atol=1e-6)
        back = _export(t, tmp_path, x[32:], want, 2e-6)
    finally:
        t.close()
    assert back.get_layer("base").trainable is False
    assert [type(x).__name__ for x in back.layers][1] == "Functional"

    base.trainable = True  # fine-tuning: every BatchNormalization back in batch mode
    km.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    t = _trainer(tmp_path, km, x, y, 3, "tune")
    try:
        assert t.spec.num_frozen == 0 and "frozen" not in t.training_line()
        ours, theirs = _steps(t, km, x, y, 3)
        np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    finally:
        t.close()


def test_a_convnext_style_nested_sequential_trains_like_keras_and_exports_nested(tmp_path, rng):
    km = _convnext()
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.normal(0.0, 1.0, (48, 8, 8, 4)).astype(np.float32)
    y = rng.integers(0, 3, 48)
    t = _trainer(tmp_path, km, x, y, 4, "convnext")
    try:
        assert "block/pw1" in [s.name for s in t.spec.config.layers]
        ours, theirs = _steps(t, km, x, y, 4)
        np.testing.assert_allclose(ours, theirs, rtol=1e-4)
        want = km.predict(x[32:], verbose=0)
        np.testing.assert_allclose(_predict(t, x[32:]), want, atol=1e-5)
        back = _export(t, tmp_path, x[32:], want, 1e-5)
    finally:
        t.close()
    assert type(back.get_layer("block")).__name__ == "Sequential"
    assert [x.name for x in back.get_layer("block").layers] == ["dwconv", "ln", "pw1", "pw2"]


def _cfg(km) -> dict:
    return json.loads(km.to_json())


def test_a_frozen_layer_without_starting_weights_is_refused_naming_it():
    i = L.Input((4,))
    km = keras.Model(i, L.Dense(3, name="head")(L.Dense(5, name="feat", trainable=False)(i)))
    with pytest.raises(InvalidSpec, match=r"'feat' \(Dense\): trainable=False needs starting"):
        keras_model.from_config(_cfg(km))  # what the operator's spec check runs
    spec = keras_model.KerasModel("m", parse(_cfg(km)))
    assert spec.num_frozen == 4 * 5 + 5 and spec.num_params == 5 * 3 + 3
    with pytest.raises(InvalidSpec, match=r"'feat' \(Dense\): trainable=False needs starting"):
        spec.init(0)
    plan = memory.plan_memory(spec, 4, True, 4, 10**9, 0)  # frozen: weights, no gradients
    assert plan.weights == 4 * (spec.num_params + spec.num_frozen)
    assert plan.gradients == 4 * spec.num_params
    assert budget.need_bytes(spec.config, 4) <= plan.total


@pytest.mark.parametrize(
    "op",
    [
        Frozen(BatchNorm((3, 4), 0.9, 1e-3, True, True), inference=True),
        Frozen(Dense((4,), 3, "tanh", True, fast=False)),
    ],
    ids=["batchnorm-inference", "linear"],
)
def test_frozen_ops_input_gradients_match_finite_differences(op, rng):
    """The shared check on a frozen op: its weights are state (random here), its only
    gradient is the input's, and a frozen BatchNormalization never moves its statistics."""
    assert op.params(0) == []
    b = 3
    bufs = op.buffers(b, True, need_dx=True)
    ws = {k: np.zeros(s, np.float64) for k, (s, _) in bufs.items()}
    for name, size, _ in op.state_specs():
        ws[name] = rng.normal(0.5, 0.3, size) if "variance" not in name else rng.random(size) + 0.5
    op.bind(ws, b)
    before = {k: ws[k].copy() for k, _, _ in op.state_specs()}
    x = rng.normal(size=(b, *(op.in_shape or (op.op.n_in,))))
    w = rng.normal(size=(b, *op.out_shape))

    def loss():
        return float(np.sum(op.forward(ws, x) * w))

    loss()
    op.backward_local(ws, w)
    dx = np.array(op.backward_input(ws, w))
    gradcheck(loss, x, dx, what=f"{op.op.kind} frozen input")
    for k, v in before.items():
        np.testing.assert_array_equal(ws[k], v)


def _siamese():
    """One Dense tower called three times (twice on one tensor), the calls' outputs merged."""
    inp = L.Input((12,))
    a = L.Dense(6, name="view_a")(inp)
    b = L.Dense(6, activation="tanh", name="view_b")(inp)
    tower = L.Dense(4, activation="tanh", name="tower")
    d = L.Subtract()([tower(a), tower(b)])
    h = L.Concatenate()([d, tower(a)])
    return keras.Model(inp, L.Dense(3, activation="softmax", name="head")(h))


def test_a_shared_dense_trains_like_keras_with_one_set_of_weights_and_exports_shared(tmp_path, rng):
    km = _siamese()
    km.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy")
    x = rng.normal(0.0, 1.0, (48, 12)).astype(np.float32)
    y = rng.integers(0, 3, 48)
    t = _trainer(tmp_path, km, x, y, 5, "siamese")
    try:
        kinds = [type(op).__name__ for op in t.spec.layers]
        assert kinds.count("Shared") == 1 and kinds.count("Tied") == 2, kinds
        assert t.spec.num_params == sum(w.numpy().size for w in km.weights)
        ours, theirs = _steps(t, km, x, y, 5)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
        got = t.spec.keras_weights(t.params, t.ipu.state)
        for w, mine in zip(km.weights, got, strict=True):
            np.testing.assert_allclose(mine, w.numpy(), atol=2e-6, err_msg=w.path)
        want = km.predict(x[32:], verbose=0)
        np.testing.assert_allclose(_predict(t, x[32:]), want, atol=2e-6)
        back = _export(t, tmp_path, x[32:], want, 2e-6)
    finally:
        t.close()
    assert len(back.get_layer("tower")._inbound_nodes) == 3


@pytest.mark.parametrize("grads_first", [False, True])
def test_shared_layer_gradients_are_summed_over_calls_by_finite_differences(grads_first, rng):
    """The whole model's gradient through the shared check: every call's contribution reaches
    the one weight (``Shared(`` owns it, ``Tied(`` calls add to it), in both stream orders."""
    spec = keras_model.from_config(_cfg(_siamese()))
    assert {type(op) for op in spec.layers} >= {Shared, Tied}
    fd_check(spec, rng, grads_first=grads_first)


@pytest.mark.slow  # 38 s: TensorFlow trains MobileNetV2 on the shared 2-core machine
def test_keras_applications_mobilenet_v2_without_top_frozen_under_a_new_head(tmp_path, rng):
    """The day-one transfer-learning model itself: ``keras.applications.MobileNetV2(
    include_top=False, weights=None)`` nested and frozen (moving statistics away from 0/1, so
    inference mode shows), a new head trained: Keras' loss at every step, the base untouched."""
    keras.utils.set_random_seed(1)
    base = keras.applications.MobileNetV2(
        include_top=False, weights=None, input_shape=(32, 32, 3), alpha=0.35
    )
    stats = []
    for w in base.weights:
        v = w.numpy()
        if "moving_variance" in w.path:
            v = np.abs(rng.normal(1.0, 0.2, v.shape))
        elif "moving_mean" in w.path:
            v = rng.normal(0.0, 0.1, v.shape)
        stats.append(v.astype(np.float32))
    base.set_weights(stats)
    base.trainable = False
    inp = L.Input((32, 32, 3))
    km = keras.Model(inp, L.Dense(5, activation="softmax")(L.GlobalAveragePooling2D()(base(inp))))
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = rng.random((48, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 5, 48)
    t = _trainer(tmp_path, km, x, y, 3, "mobilenet_v2")
    try:
        assert t.spec.num_params == 1280 * 5 + 5
        assert t.spec.num_frozen == sum(
            w.numpy().size for w in base.weights if "moving" not in w.path
        )
        ours, theirs = _steps(t, km, x, y, 3)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
        got = t.spec.keras_weights(t.params, t.ipu.state)
        at = {id(w): k for k, w in enumerate(base.weights)}
        pairs = zip(km.weights, got, strict=True)
        frozen = [(mine, stats[at[id(w)]]) for w, mine in pairs if id(w) in at]
        assert len(frozen) == len(base.weights)
        for mine, start in frozen:
            np.testing.assert_array_equal(mine, start)
        np.testing.assert_allclose(got[-2], km.weights[-2].numpy(), atol=2e-6)
    finally:
        t.close()


@pytest.mark.parametrize("name", ["siamese_shared", "transfer_frozen"])
def test_shared_and_frozen_models_split_over_replicas_and_host_threads_alike(
    name, tmp_path, monkeypatch
):
    """Each replica or host thread has its own programs, accumulators and state: the weights
    after a few steps do not depend on how one worker's batch is split."""
    from support import zoo

    from ringtrain_trainer import worker

    monkeypatch.setattr(worker, "MIN_SHARD_FLOPS", 0)  # this small batch: still two shards

    model, data = zoo.save(zoo.ZOO[name], tmp_path)
    ends = []
    splits = (
        [],
        ["--ipu-host-threads", "2"],
        ["--ipus-per-worker", "2"],
        ["--ipus-per-worker", "3"],
    )
    for k, split in enumerate(splits):
        args = ["--model", model, "--data", data, "--steps", "3", "--batch-size", "24", "--json"]
        args += [
            "--checkpoint-dir",
            str(tmp_path / f"ck{k}"),
            *(split or ["--ipu-host-threads", "1"]),
        ]
        t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
        try:
            for _ in range(3):
                t.train_one_step()
            ends.append(t.params.copy())
            if t.spec.num_frozen:  # never averaged over replicas, so never a rounding off
                assert not t.spec.live_state
                np.testing.assert_array_equal(t.ipu.state, t.spec.init_state())
        finally:
            t.close()
    for other in ends[1:]:
        np.testing.assert_allclose(other, ends[0], rtol=0, atol=1e-6)


def test_a_layer_shared_inside_a_nested_model_predicts_and_exports_like_keras(tmp_path, rng):
    i = L.Input((5,))
    d = L.Dense(5, activation="tanh", name="twice")
    inner = keras.Model(i, L.Add(name="sum")([d(i), d(d(i))]), name="inner")
    inp = L.Input((5,))
    km = keras.Model(inp, L.Dense(3, activation="softmax", name="out")(inner(inp)))
    km.set_weights([rng.normal(0, 0.5, w.shape).astype(np.float32) for w in km.weights])
    km.save(tmp_path / "m.keras")
    spec = keras_model.load(str(tmp_path / "m.keras"))
    names = sorted(s.name for s in spec.config.layers)
    assert names == ["inner/sum", "inner/twice", "inner/twice@1", "inner/twice@2", "out"]
    x = rng.normal(size=(6, 5)).astype(np.float32)
    prog = M.Program(spec, 6, False, state=spec.init_state())
    prog.x[:] = x
    z = prog.forward(spec.views(spec.init(0))).astype(np.float64)
    e = np.exp(z - z.max(1, keepdims=True))
    want = km.predict(x, verbose=0)
    np.testing.assert_allclose(e / e.sum(1, keepdims=True), want, atol=1e-6)
    cfg = spec.keras_config()
    back = keras.saving.load_model(
        write_keras(tmp_path / "o.keras", cfg, spec.keras_weights(spec.init(0)))
    )
    np.testing.assert_allclose(back.predict(x, verbose=0), want, atol=1e-6)
    assert len(back.get_layer("inner").get_layer("twice")._inbound_nodes) == 3


def test_fp16_with_frozen_layers_is_refused_before_training(tmp_path):
    from support import zoo

    model, data = zoo.save(zoo.ZOO["transfer_frozen"], tmp_path)
    args = ["--model", model, "--data", data, "--steps", "1", "--precision", "fp16"]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    with pytest.raises(InvalidSpec, match=r"fp16 .* with 256 frozen parameters"):
        Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())


def test_the_calls_of_a_shared_layer_in_two_pipeline_stages_are_refused(tmp_path, rng):
    i = L.Input((4,))
    tower = L.Dense(4, activation="tanh", name="tower")
    km = keras.Model(i, L.Dense(3, activation="softmax", name="head")(tower(tower(i))))
    km.save(tmp_path / "m.keras")
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, 16)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--ipus-per-worker", "2", "--pipeline-stages", "tower@1", "--batch-size", "4"]
    args += ["--steps", "1", "--checkpoint-dir", str(tmp_path / "ck")]
    with pytest.raises(InvalidSpec, match=r"shared layer 'tower' is called in stages 0 and 1"):
        Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())


def _siamese_tower() -> keras.Model:
    """keras.io's Siamese pattern: one tower model applied to two inputs, the embeddings
    compared by a head."""
    tower = keras.Sequential(
        [L.Input((8,)), L.Dense(6, "relu", name="d1"), L.Dense(4, name="d2")], name="tower"
    )
    a, b = L.Input((8,), name="left"), L.Input((8,), name="right")
    diff = L.Subtract(name="diff")([tower(a), tower(b)])
    out = L.Dense(1, "sigmoid", name="head")(L.Multiply(name="sq")([diff, diff]))
    m = keras.Model([a, b], out)
    m.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.5), loss="binary_crossentropy")
    return m


def test_a_nested_model_called_twice_trains_as_one_shared_tower_like_keras(tmp_path, rng):
    km = _siamese_tower()
    x = {k: rng.normal(size=(40, 8)).astype(np.float32) for k in ("left", "right")}
    y = rng.integers(0, 2, 40).astype(np.float32)
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, 5, 8, n_train=32)
    try:
        names = [s.name for s in t.spec.config.layers]
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    assert {"tower/d1", "tower/d1@1", "tower/d2", "tower/d2@1"} <= set(names)
    follows_keras(ours, theirs, weights, km, rtol=1e-5, atol=1e-6)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    (tower,) = [layer for layer in back.layers if layer.name == "tower"]
    assert isinstance(tower, keras.Sequential) and len(tower._inbound_nodes) == 2
    probe = {k: v[32:] for k, v in x.items()}
    np.testing.assert_allclose(back.predict(probe, verbose=0), km.predict(probe, verbose=0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_layer_shared_inside_a_shared_nested_model_is_refused_by_name():
    inner = L.Dense(3, name="twice")
    i = L.Input((3,))
    tower = keras.Model(i, inner(inner(i)), name="tower")
    a, b = L.Input((3,)), L.Input((3,))
    m = keras.Model([a, b], L.Add()([tower(a), tower(b)]))
    with pytest.raises(InvalidSpec, match=r"'twice' is called 2 times inside a nested model"):
        parse(json.loads(m.to_json()), compiled=False)
