"""Everyday Keras layers a user trial found refused (issue 19, trial3): Identity,
UnitNormalization, GroupNormalization, Dot and CategoryEncoding. Each new op against finite
differences (``support.opcheck``), a small model built by real Keras trained by ringtrain and
by Keras from the same ``.keras`` weights on the same batches (loss per step, weights after),
the ``.keras`` export reloaded by Keras and the ONNX export run by onnxruntime.

Imports TensorFlow (slow): one module holds these comparisons."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from support.gradcheck import gradcheck
from support.keras_steps import follows_keras, train_beside_keras
from support.opcheck import check_gradients, compile_op, forward

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.category import CategoryEncode
from ringtrain_trainer.engine.ops.dot import Dot
from ringtrain_trainer.engine.ops.groupnorm import GroupNorm
from ringtrain_trainer.engine.ops.unitnorm import UnitNorm
from ringtrain_trainer.export import write_keras, write_onnx
from ringtrain_trainer.keras import load as keras_model
from ringtrain_trainer.keras.config import parse

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)
L = keras.layers


def _beside(km, x, y, tmp_path, steps=4, batch=8, n=32, rtol=1e-4, onnx=True):
    """Train ``km`` (compiled) beside ringtrain; compare losses, weights, and both exports'
    predictions with Keras' own. Returns the reloaded Keras model."""
    ours, theirs, t = train_beside_keras(km, x, y, tmp_path, steps, batch, n_train=n)
    try:
        config, weights = t.spec.keras_config(), t.spec.keras_weights(t.params, t.ipu.state)
    finally:
        t.close()
    follows_keras(ours, theirs, weights, km, rtol=rtol, atol=1e-5)
    xt = {k: v[n:] for k, v in x.items()} if isinstance(x, dict) else x[n:]
    want = km.predict(xt, verbose=0)
    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    np.testing.assert_allclose(back.predict(xt, verbose=0), want, atol=2e-5)
    if onnx:
        write_onnx(tmp_path / "m.onnx", config, weights)
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        feed = dict(xt) if isinstance(xt, dict) else {sess.get_inputs()[0].name: xt}
        types = {i.name: i.type for i in sess.get_inputs()}  # the writer's inputs are float
        feed = {
            k: v.astype(np.float32) if types[k] == "tensor(float)" else v for k, v in feed.items()
        }
        np.testing.assert_allclose(sess.run(None, feed)[0], want, atol=2e-5)
    return back


def test_identity_builds_to_nothing_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential([L.Input((4,)), L.Identity(), L.Dense(1)])
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = x.sum(1, keepdims=True).astype(np.float32)
    back = _beside(km, x, y, tmp_path)
    assert type(back.layers[0]).__name__ == "Identity"
    import onnx

    assert "Identity" in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}


@pytest.mark.parametrize("shape", [(5,), (3, 4)])
def test_unit_norm_gradients(shape, rng):
    check_gradients(UnitNorm(shape), rng)


def test_unit_norm_is_keras_formula_also_on_a_zero_vector(rng):
    x = rng.normal(size=(3, 2, 4)).astype(np.float32)
    x[1, 0] = 0.0
    want = np.asarray(L.UnitNormalization()(x))
    np.testing.assert_allclose(forward(UnitNorm((2, 4)), x, {}, np.float32), want, atol=1e-6)
    assert np.all(want[1, 0] == 0)


def test_unit_normalization_trains_like_keras_and_exports(tmp_path, rng):
    km = keras.Sequential([L.Input((8,)), L.Dense(4), L.UnitNormalization(), L.Dense(1)])
    km.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x = rng.normal(size=(40, 8)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    _beside(km, x, y, tmp_path)


def _config(*layers) -> dict:
    return json.loads(keras.Sequential([*layers]).to_json())


def test_unit_normalization_off_the_last_axis_is_refused_by_name():
    with pytest.raises(InvalidSpec, match=r"UnitNormalization.*axis=\[1, 2\]"):
        parse(_config(L.Input((3, 4)), L.UnitNormalization(axis=[1, 2])), compiled=False)


@pytest.mark.parametrize(
    "op",
    [GroupNorm((3, 3, 4), 2), GroupNorm((5, 6), 3, 1e-3, False, True), GroupNorm((4,), 4)],
    ids=["2d-2groups", "1d-scale-only", "one-per-channel"],
)
def test_group_norm_gradients(op, rng):
    check_gradients(op, rng)


@pytest.mark.parametrize("groups, center", [(4, True), (-1, False), (1, True)])
def test_group_normalization_trains_like_keras_and_exports(groups, center, tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((6, 6, 2)),
            L.Conv2D(8, 3),
            L.GroupNormalization(groups=groups, center=center, epsilon=1e-2),
            L.Activation("relu"),
            L.GlobalAveragePooling2D(),
            L.Dense(1),
        ]
    )
    # SGD: with one channel per group the conv's bias has no gradient but rounding, which
    # Adam would blow up into full steps
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.normal(size=(40, 6, 6, 2)).astype(np.float32)
    y = x.mean((1, 2, 3))[:, None].astype(np.float32)
    _beside(km, x, y, tmp_path)


def test_group_normalization_refusals_name_the_argument():
    with pytest.raises(InvalidSpec, match=r"GroupNormalization.*axis=1"):
        parse(_config(L.Input((4, 6)), L.GroupNormalization(2, axis=1)), compiled=False)


@pytest.mark.parametrize(
    "shapes, axes, normalize",
    [
        ([(5,), (5,)], (0, 0), False),
        ([(5,), (5,)], (0, 0), True),
        ([(3, 4), (2, 4)], (1, 1), False),
        ([(3, 4), (2, 4)], (1, 1), True),
        ([(3, 4), (3, 2)], (0, 0), False),
        ([(3, 4), (2, 3)], (0, 1), False),
    ],
    ids=["vectors", "cosine", "last-axes", "last-axes-cosine", "first-axes", "first-second"],
)
def test_dot_gradients_of_both_inputs_and_keras_forward(shapes, axes, normalize, rng):
    op = Dot(shapes, axes, normalize)
    ws = compile_op(op, 3)
    xs = [rng.normal(size=(3, *s)) for s in shapes]
    w = rng.normal(size=(3, *op.out_shape))

    def loss() -> float:
        return float(np.sum(op.forward(ws, *xs) * w))

    keras_axes = [a + 1 for a in axes]
    want = L.Dot(axes=keras_axes, normalize=normalize)([x.astype(np.float32) for x in xs])
    np.testing.assert_allclose(op.forward(ws, *xs), np.asarray(want), rtol=1e-5, atol=1e-5)
    loss()
    grads = [np.array(g) for g in op.backward_input(ws, w)]
    for k in range(2):
        gradcheck(loss, xs[k], grads[k], what=f"Dot input {k}")


def _recommender(normalize: bool) -> keras.Model:
    u, i = (
        keras.Input((1,), dtype="int32", name="user"),
        keras.Input((1,), dtype="int32", name="item"),
    )
    ue = L.Flatten()(L.Embedding(20, 4)(u))
    ie = L.Flatten()(L.Embedding(30, 4)(i))
    return keras.Model([u, i], L.Dot(axes=1, normalize=normalize)([ue, ie]))


@pytest.mark.parametrize("normalize", [False, True])
def test_dot_recommender_trains_like_keras_and_exports(normalize, tmp_path, rng):
    km = _recommender(normalize)
    km.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    x = {"user": rng.integers(0, 20, (40, 1)).astype(np.int32)}
    x["item"] = rng.integers(0, 30, (40, 1)).astype(np.int32)
    y = ((x["user"] + x["item"]) % 2).astype(np.float32)
    _beside(km, x, y, tmp_path)


def test_dot_batch_matmul_trains_like_keras_and_exports(tmp_path, rng):
    a, b = keras.Input((3, 4), name="a"), keras.Input((2, 4), name="b")
    scores = L.Dot(axes=2)([L.Dense(4)(a), b])  # (3, 2)
    km = keras.Model([a, b], L.Dense(1)(L.Flatten()(scores)))
    km.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = {"a": rng.normal(size=(40, 3, 4)).astype(np.float32)}
    x["b"] = rng.normal(size=(40, 2, 4)).astype(np.float32)
    y = x["a"].sum((1, 2))[:, None].astype(np.float32)
    _beside(km, x, y, tmp_path)


def test_dot_of_unsupported_shapes_is_refused_by_name():
    a, b = keras.Input((3, 4)), keras.Input((4,))
    km = keras.Model([a, b], L.Dot(axes=(2, 1))([a, b]))
    with pytest.raises(InvalidSpec, match=r"Dot.*\(3, 4\), \(4,\)"):
        parse(json.loads(km.to_json()), compiled=False)


@pytest.mark.parametrize(
    "mode, k", [("one_hot", 1), ("one_hot", 3), ("multi_hot", 3), ("count", 4)]
)
def test_category_encoding_equals_keras(mode, k, rng):
    ids = rng.integers(0, 5, (6, k))
    want = np.asarray(L.CategoryEncoding(num_tokens=5, output_mode=mode)(ids))
    got = forward(CategoryEncode((k,), 5, mode), ids.astype(np.float32), {}, np.float32)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        forward(CategoryEncode((k,), 5, mode), np.full((2, k), 5.0), {})


@pytest.mark.parametrize("mode, k", [("one_hot", 1), ("multi_hot", 3), ("count", 3)])
def test_category_encoding_trains_like_keras_and_exports(mode, k, tmp_path, rng):
    km = keras.Sequential(
        [
            L.Input((k,), dtype="int64"),
            L.CategoryEncoding(num_tokens=10, output_mode=mode),
            *([L.Flatten()] if k > 1 and mode == "one_hot" else []),
            L.Dense(1),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.integers(0, 10, (40, k)).astype(np.int64)
    y = (x[:, :1] % 3).astype(np.float32)
    _beside(km, x, y, tmp_path)


def test_category_encoding_off_a_model_input_or_sparse_is_refused_by_name(tmp_path):
    km = keras.Sequential([L.Input((2,)), L.Dense(2), L.CategoryEncoding(num_tokens=4), L.Dense(1)])
    km.compile("sgd", "mse")
    km.save(tmp_path / "m.keras")
    with pytest.raises(
        InvalidSpec, match=r"'category_encoding\w*' \(CategoryEncoding\).*model input"
    ):
        keras_model.load(str(tmp_path / "m.keras"))
    # Keras 3's get_config leaves sparse out; tf.keras 2 wrote it: refused where written
    sparse = _config(L.Input((2,), dtype="int32"), L.CategoryEncoding(4))
    sparse["config"]["layers"][-1]["config"]["sparse"] = True
    with pytest.raises(InvalidSpec, match=r"CategoryEncoding.*sparse=True"):
        parse(sparse, compiled=False)


def test_the_mask_passes_through_identity_and_the_normalizations_as_in_keras(tmp_path, rng):
    """Keras 3 gives all three ``supports_masking`` and ignores the mask in ``call``: an
    ``Embedding(mask_zero=True)``'s mask still reaches the LSTM behind them."""
    km = keras.Sequential(
        [
            L.Input((6,), dtype="int32"),
            L.Embedding(12, 4, mask_zero=True),
            L.Identity(),
            L.UnitNormalization(),
            L.GroupNormalization(2),
            L.LSTM(3),
            L.Dense(1),
        ]
    )
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.integers(1, 12, (40, 6)).astype(np.int32)
    x[:, 4:] = 0  # padding: masked steps
    y = (x[:, :1] % 2).astype(np.float32)
    _beside(km, x, y, tmp_path, steps=3, onnx=False)
