"""Keras 3 masks end to end against real Keras: padded token sequences through
``Embedding(mask_zero=True)`` into an LSTM, a Bidirectional GRU with a masked global average,
a transformer block whose attention takes the padding masks with ``use_causal_mask``, and
``Masking`` on float sequences into a backwards SimpleRNN. Each model is saved by Keras as a
``.keras`` file and trained by ringtrain's worker from those weights on the same batches as
``train_on_batch``: the same loss at every step (rel 2e-4), the same predictions afterwards,
and an export Keras reloads with ringtrain's predictions. Also: 2 workers ≡ 1 worker on a
masked model, and the layers that cannot honour a mask are refused by name."""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.export.onnx_file import write_onnx
from ringtrain_trainer.keras import masks
from ringtrain_trainer.keras.config import parse
from ringtrain_trainer.worker import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword"
)
L = keras.layers
VOCAB, SEQ, CLASSES, FEAT = 30, 8, 3, 3


def lstm_classifier():
    return keras.Sequential(
        [
            L.Input((SEQ,), dtype="int32"),
            L.Embedding(VOCAB, 8, mask_zero=True),
            L.LSTM(6),
            L.Dense(CLASSES),
        ]
    )


def bidirectional_gru():
    return keras.Sequential(
        [
            L.Input((SEQ,), dtype="int32"),
            L.Embedding(VOCAB, 8, mask_zero=True),
            L.Bidirectional(L.GRU(5, return_sequences=True)),
            L.Dense(4, activation="tanh"),
            L.GlobalAveragePooling1D(),
            L.Dense(CLASSES),
        ]
    )


def transformer_block():
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, 8, mask_zero=True)(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h, use_causal_mask=True)
    h = L.LayerNormalization()(L.Add()([h, a]))
    f = L.Dense(8)(L.Dense(16, activation="relu")(h))
    h = L.LayerNormalization()(L.Add()([h, f]))
    return keras.Model(inp, L.Dense(CLASSES)(L.GlobalAveragePooling1D()(h)))


def cross_attention():
    """The query and a separate key carry the mask, the value does not: Keras ANDs the
    query's rows with the key's columns (three heads)."""
    inp = keras.Input((SEQ,), dtype="int32")
    q = L.Embedding(VOCAB, 8, mask_zero=True)(inp)
    v = L.Embedding(VOCAB, 6)(inp)
    k = L.Dense(5)(q)
    a = L.MultiHeadAttention(num_heads=3, key_dim=2)(q, v, k)
    return keras.Model(inp, L.Dense(CLASSES)(L.GlobalAveragePooling1D()(a)))


def masking_residual():
    """Functional: Keras spells the merged mask out as ``Any(NotEqual(x, 0))`` → ``LogicalOr``
    and hands it to the average as its ``mask`` argument."""
    inp = keras.Input((SEQ, FEAT))
    h = L.Masking(0.0)(inp)
    h = L.Add()([h, L.Dense(FEAT, activation="tanh")(h)])
    return keras.Model(inp, L.Dense(CLASSES)(L.GlobalAveragePooling1D()(h)))


def concatenated_bidirectional():
    """Two masked embeddings concatenated (Keras spells the mask out with ExpandDims,
    ZerosLike, LogicalOr, ops.concatenate, Any) into a Bidirectional LSTM summing its halves."""
    inp = keras.Input((SEQ,), dtype="int32")
    e1 = L.Embedding(VOCAB, 4, mask_zero=True)(inp)
    e2 = L.Embedding(VOCAB, 4, mask_zero=True)(inp)
    c = L.Concatenate()([e1, L.Dense(3)(e2)])
    b = L.Bidirectional(L.LSTM(4), merge_mode="sum")(c)
    return keras.Model(inp, L.Dense(CLASSES)(b))


def masking_rnn():
    return keras.Sequential(
        [
            L.Input((SEQ, FEAT)),
            L.Masking(0.0),
            L.LSTM(5, return_sequences=True, go_backwards=True),
            L.SimpleRNN(4, go_backwards=True),
            L.Dense(CLASSES),
        ]
    )


def padded_tokens(rng, n):
    """Token ids with zero padding: right-padded, left-padded and with holes, never empty."""
    x = rng.integers(1, VOCAB, (n, SEQ))
    lengths = rng.integers(1, SEQ + 1, n)
    for i, k in enumerate(lengths):
        if i % 3 == 0:
            x[i, k:] = 0
        elif i % 3 == 1:
            x[i, : SEQ - k] = 0
        else:
            x[i, rng.random(SEQ) < 0.3] = 0
            x[i, 0] = 1 + i % (VOCAB - 1)
    return x


def _data(build, rng):
    if build in (masking_rnn, masking_residual):
        x = rng.normal(size=(48, SEQ, FEAT)).astype(np.float32)
        x[padded_tokens(rng, 48) == 0] = 0.0
        y = (x[:, :, 0].sum(1) > 0).astype(np.int64) + (x[:, -1, 1] > 0)
    else:
        x = padded_tokens(rng, 48)
        y = (x.max(1) % CLASSES).astype(np.int64)
    return x, y


def _trainer(tmp_path, x, y, extra=(), collective=None):
    data = Dataset(
        "seq",
        Split(x[:32].astype(np.float32), y[:32]),
        Split(x[32:].astype(np.float32), y[32:]),
        CLASSES,
    )
    args = ["--model", str(tmp_path / "m.keras"), "--steps", "5", "--batch-size", "8"]
    args += ["--optimizer", "sgd", "--lr", "0.1", "--ipu-host-threads", "1"]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--export", str(tmp_path / "out.keras")]
    args += list(extra)
    return Trainer(
        TrainerConfig.from_args(args, {}), collective or LocalCollective(), data, out=io.StringIO()
    )


def _saved(build, tmp_path):
    keras.utils.set_random_seed(3)
    km = build()
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss=lossf)
    km.save(tmp_path / "m.keras")
    return km


@pytest.mark.parametrize(
    "build",
    [
        lstm_classifier,
        bidirectional_gru,
        transformer_block,
        cross_attention,
        concatenated_bidirectional,
        masking_rnn,
        masking_residual,
    ],
)
def test_a_masked_model_trains_like_keras_step_by_step(build, tmp_path, rng):
    km = _saved(build, tmp_path)
    x, y = _data(build, rng)
    t = _trainer(tmp_path, x, y)
    curve = []
    try:
        for _ in range(5):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            loss, _, _ = t.train_one_step()
            want = float(km.train_on_batch(x[idx], y[idx]))
            curve.append((loss, want))
            assert loss == pytest.approx(want, rel=2e-4)
        want = km.predict(x[32:], verbose=0)
        assert t.evaluate() == float(np.mean(want.argmax(1) == y[32:]))
        exported = t.export(loss)
        weights = t.spec.keras_weights(t.params, t.state)
        with pytest.raises(InvalidSpec, match="mask"):
            write_onnx(tmp_path / "m.onnx", t.spec.keras_config(), weights)
    finally:
        t.close()
    got = keras.saving.load_model(exported, compile=False).predict(x[32:], verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the mask matters: the same weights without it give other predictions
    assert len({round(a, 6) for a, _ in curve}) > 1


def _config(*layers, inp=None):
    inp = inp or L.Input((SEQ,), dtype="int32")
    return keras.Sequential([inp, *layers]).get_config()


@pytest.mark.parametrize(
    ("layers", "refused"),
    [
        ([L.Embedding(VOCAB, 4, mask_zero=True), L.BatchNormalization()], "BatchNormalization"),
        ([L.Embedding(VOCAB, 4, mask_zero=True), L.Softmax()], "Softmax"),
        (
            [L.Embedding(VOCAB, 4, mask_zero=True), L.Dense(CLASSES)],
            "output still carries a mask",
        ),
    ],
)
def test_a_layer_that_cannot_honour_a_mask_is_refused_by_name(layers, refused):
    cfg = {"class_name": "Sequential", "config": _config(*layers)}
    with pytest.raises(InvalidSpec, match=refused):
        parse(cfg, compiled=False)


def test_a_layer_keras_drops_the_mask_at_drops_it_as_keras_does():
    """Flatten has no ``supports_masking``: Keras warns and forgets the mask; so does ringtrain."""
    with pytest.warns(UserWarning, match="destroy the mask information"):
        layers = [L.Embedding(VOCAB, 4, mask_zero=True), L.Flatten(), L.Dense(CLASSES)]
        cfg = {"class_name": "Sequential", "config": _config(*layers)}
    assert parse(cfg, compiled=False).layers[0].args["mask_zero"] is True
    assert masks.propagate(parse(cfg, compiled=False).layers, (3,)) == {1: ("zero", 0)}


@pytest.mark.parametrize("build", [bidirectional_gru, transformer_block])
def test_two_workers_of_a_masked_model_equal_one_worker_with_both_halves(build, rng):
    """2 workers x batch 4 (gradients averaged as the ring does) == 1 worker x batch 8: each
    example's mask is its own, and both workers build the same graph and layout."""
    from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
    from ringtrain_trainer.keras.load import KerasModel

    keras.utils.set_random_seed(3)
    cfg = parse(json.loads(build().to_json()), compiled=False)
    x, y = _data(build, rng)
    x, y = x[:8].astype(np.float32), y[:8]

    def ipu(rank):
        spec = KerasModel("m", cfg)
        params = spec.init(1)
        conf = IPUConfig(memory_bytes=900 * MB, replicas=1, host_threads=1, rank=rank, seed=4)
        return spec, IPU(spec, conf, params, np.zeros_like(params))

    (s1, one), halves = ipu(0), [ipu(r) for r in range(2)]
    assert all(s.slots == s1.slots for s, _ in halves)
    one.train_step(one.compile(8), x, y, step=1)
    for r, (_, w) in enumerate(halves):
        w.train_step(w.compile(4), x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4], step=1)
    ring = (halves[0][1].host_grads + halves[1][1].host_grads) / 2
    assert np.abs(one.host_grads).max() > 0
    np.testing.assert_allclose(one.host_grads, ring, rtol=1e-5, atol=1e-7)


def test_a_mask_argument_other_than_the_propagated_one_is_refused_naming_the_layer():
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, 4)(inp)
    pooled = L.GlobalAveragePooling1D(name="pool")(h, mask=keras.ops.not_equal(inp, 0))
    cfg = json.loads(keras.Model(inp, L.Dense(CLASSES)(pooled)).to_json())
    with pytest.raises(InvalidSpec, match=r"'pool' \(GlobalAveragePooling1D\): its mask argument"):
        parse(cfg, compiled=False)


@pytest.mark.parametrize("build", [bidirectional_gru, transformer_block, masking_rnn])
def test_a_masked_model_matches_finite_differences_through_the_program(build, rng):
    """The whole compiled program in float64 (mask nodes without backward, the ids read by
    both the Embedding and the mask, the embedding fanned out to attention and the residual)
    against the one finite-difference helper."""
    from support.gradcheck import check_model

    from ringtrain_trainer.engine.program import Program
    from ringtrain_trainer.keras.load import KerasModel

    keras.utils.set_random_seed(3)
    spec = KerasModel("m", parse(json.loads(build().to_json()), compiled=False))
    assert spec.graph.no_grad
    x, y = _data(build, rng)
    flat = spec.init(3, np.float64) + rng.normal(0, 0.05, spec.num_params)
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = Program(spec, 4, True, np.float64)
    prog.x[:] = x[:4]
    prog.labels[:] = y[:4]

    def loss():
        return prog.loss_and_dlogits(prog.forward(views))

    loss()
    for _ in prog.backward_pieces(views, gviews):
        pass
    check_model(spec, flat, grad, loss, rng, samples=6)
