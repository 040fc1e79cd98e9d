"""The sequence layers' registry entries without TensorFlow: what they refuse, by argument,
before anything runs, and what a fresh model starts from."""

import numpy as np
import pytest
from test_keras_layers import layer, seq

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import load as KM


def functional(shape, *layers, dtype="int32"):
    """A chain as a Keras 3 Functional config: each layer reads the one before it."""
    prev, items = "inp", []
    for cls, name, cfg, call in layers:
        tensor = {"class_name": "__keras_tensor__", "config": {"keras_history": [prev, 0, 0]}}
        args = [tensor, tensor] if cls == "MultiHeadAttention" else [tensor]
        item = {"class_name": cls, "name": name, "config": {"name": name, **cfg}}
        item["inbound_nodes"] = [{"args": args, "kwargs": call}]
        items.append(item)
        prev = name
    inp = {"class_name": "InputLayer", "name": "inp"}
    inp["config"] = {"name": "inp", "batch_shape": [None, *shape], "dtype": dtype}
    return {
        "class_name": "Functional",
        "config": {
            "name": "f",
            "layers": [{**inp, "inbound_nodes": []}, *items],
            "input_layers": ["inp", 0, 0],
            "output_layers": [prev, 0, 0],
        },
    }


def text(*middle):
    return seq(
        (6,),
        layer("Embedding", "e", input_dim=10, output_dim=4),
        *middle,
        layer("Flatten", "f"),
        layer("Dense", "d", units=3),
    )


@pytest.mark.parametrize(
    "bad, words",
    [
        (layer("LSTM", "l", units=3, stateful=True), "'l' (LSTM): stateful=True"),
        (layer("LSTM", "l", units=3, return_state=True), "return_state=True"),
        (layer("LSTM", "l", units=3, recurrent_dropout=1.0), "'l' (LSTM): recurrent_dropout=1.0"),
        (
            layer("GRU", "g", units=3, reset_after=False, recurrent_dropout=0.2),
            "'g' (GRU): recurrent_dropout=0.2",
        ),
        (layer("GRU", "g", units=3, recurrent_activation="softmax"), "recurrent_activation"),
        (layer("LSTM", "l", units=3, recurrent_initializer="my_init"), "recurrent_initializer"),
        (layer("LayerNormalization", "n", rms_scaling=True), "'n' (LayerNormalization): rms"),
        (layer("LayerNormalization", "n", axis=1), "axis=1 is not the last axis"),
    ],
)
def test_unsupported_sequence_arguments_are_refused_naming_them(bad, words):
    with pytest.raises(InvalidSpec, match=words.replace("(", r"\(").replace(")", r"\)")):
        KM.from_config(text(bad))


def test_a_mask_left_on_the_output_and_an_attention_dropout_out_of_range_are_refused():
    with pytest.raises(InvalidSpec, match=r"the model's output still carries a mask"):
        KM.from_config(
            seq((6,), layer("Embedding", "e", input_dim=5, output_dim=2, mask_zero=True))
        )
    mha = ("MultiHeadAttention", "a", {"num_heads": 2, "key_dim": 2, "dropout": 1.5}, {})
    emb = ("Embedding", "e", {"input_dim": 5, "output_dim": 4}, {})
    with pytest.raises(InvalidSpec, match=r"'a' \(MultiHeadAttention\): dropout=1.5"):
        KM.from_config(functional((6,), emb, mha))
    call = (
        "MultiHeadAttention",
        "a",
        {"num_heads": 2, "key_dim": 2},
        {"return_attention_scores": True},
    )
    with pytest.raises(InvalidSpec, match="call argument return_attention_scores=True"):
        KM.from_config(functional((6,), emb, call))


def test_an_int_input_and_a_causal_call_reach_the_ops():
    mha = ("MultiHeadAttention", "a", {"num_heads": 2, "key_dim": 3}, {"use_causal_mask": True})
    emb = ("Embedding", "e", {"input_dim": 5, "output_dim": 4}, {})
    dense = ("Dense", "d", {"units": 2}, {})
    rnn = ("LSTM", "l", {"units": 3}, {"training": False, "mask": None})  # as Keras writes it
    spec = KM.from_config(functional((6,), emb, mha, rnn, dense))
    assert spec.config.input_dtype == "int32"
    att = next(op for op in spec.layers if type(op).__name__ == "MultiHeadAttention")
    assert att.causal and att.in_shapes == [(6, 4), (6, 4)]
    with pytest.raises(InvalidSpec, match="dtype='float16'"):
        KM.from_config(functional((6,), emb, dtype="float16"))


def test_a_fresh_embedding_starts_from_keras_uniform_range():
    spec = KM.from_config(text())
    slot = next(s for s in spec.slots if s.spec.name == "embeddings")
    w = spec.init(0)[slot.start : slot.stop]
    assert 0.04 < np.abs(w).max() <= 0.05 and np.abs(w.mean()) < 0.01


def _rnn(cls, name, units, **cfg):
    return (cls, name, {"units": units, **cfg}, {})


def _bi(name, inner, **cfg):
    cls, _, icfg, _ = inner
    return ("Bidirectional", name, {"layer": {"class_name": cls, "config": icfg}, **cfg}, {})


@pytest.mark.parametrize(
    "middle",
    [
        [_rnn("LSTM", "l", 4, return_sequences=True, go_backwards=True), _rnn("GRU", "g", 3)],
        [_bi("b", _rnn("LSTM", "l", 3, return_sequences=True)), _rnn("GRU", "g", 2)],
        [_bi("b", _rnn("GRU", "g", 3, return_sequences=True), merge_mode="sum")],
        [_bi("b", _rnn("LSTM", "l", 3), merge_mode="ave")],
        [_rnn("SimpleRNN", "s", 3, return_sequences=True, go_backwards=True), _rnn("GRU", "g", 2)],
        [_bi("b", _rnn("SimpleRNN", "s", 3, activation="relu"), merge_mode="concat")],
        [_bi("b", _rnn("GRU", "g", 3), merge_mode="mul")],
    ],
    ids=["backwards", "bi-concat-seq", "bi-sum-seq", "bi-ave", "simple", "bi-simple", "bi-mul"],
)
def test_the_onnx_export_computes_what_the_ipu_computes(middle, rng):
    """Every RNN direction and merge mode through onnxruntime, from ringtrain's own weights."""
    import onnxruntime as ort

    from ringtrain_trainer.engine import model as M
    from ringtrain_trainer.export.onnx_file import to_onnx

    emb = ("Embedding", "e", {"input_dim": 7, "output_dim": 4}, {})
    top = middle[-1][2]
    seq = top.get("layer", {"config": top})["config"].get("return_sequences")
    last = [("Flatten", "f", {}, {})] if seq else []
    spec = KM.from_config(functional((5,), emb, *middle, *last, ("Dense", "d", {"units": 3}, {})))
    flat = spec.init(1) + rng.normal(0, 0.3, spec.num_params).astype(np.float32)
    x = rng.integers(0, 7, (4, 5)).astype(np.float32)
    prog = M.Program(spec, 4, False)
    prog.x[:] = x
    want = prog.forward(spec.views(flat))
    model = to_onnx(spec.keras_config(), spec.keras_weights(flat))
    sess = ort.InferenceSession(model.SerializeToString())
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_bidirectional_layer_onnx_cannot_express_is_refused_on_export(rng):
    from ringtrain_trainer.export.onnx_file import to_onnx

    emb = ("Embedding", "e", {"input_dim": 7, "output_dim": 4}, {})
    bi = _bi("b", _rnn("LSTM", "l", 2, go_backwards=True))
    spec = KM.from_config(functional((5,), emb, bi, ("Dense", "d", {"units": 3}, {})))
    with pytest.raises(InvalidSpec, match=r"'b' \(Bidirectional\): ONNX needs two halves"):
        to_onnx(spec.keras_config(), spec.keras_weights(spec.init(0)))


def _graph(shape, nodes, dtype="int32"):
    """A Functional config from ``(cls, name, cfg, inputs, call)`` nodes, inputs by name; Add
    takes its inputs as one list, the others positionally."""

    def tensor(name):
        return {"class_name": "__keras_tensor__", "config": {"keras_history": [name, 0, 0]}}

    items = []
    for cls, name, cfg, inputs, call in nodes:
        ts = [tensor(i) for i in inputs]
        args = [ts] if cls == "Add" else ts
        item = {"class_name": cls, "name": name, "config": {"name": name, **cfg}}
        items.append({**item, "inbound_nodes": [{"args": args, "kwargs": call}]})
    cfg = {"name": "inp", "batch_shape": [None, *shape], "dtype": dtype}
    inp = {"class_name": "InputLayer", "name": "inp", "config": cfg, "inbound_nodes": []}
    return {
        "class_name": "Functional",
        "config": {
            "name": "g",
            "layers": [inp, *items],
            "input_layers": ["inp", 0, 0],
            "output_layers": [nodes[-1][1], 0, 0],
        },
    }


@pytest.mark.parametrize("grads_first", [False, True])
def test_a_whole_sequence_graph_matches_finite_differences(grads_first, rng):
    """Fan-out included: attention reads its input twice and the residual Add reads it again;
    every parameter through the Program's own backward schedule, in float64."""
    from support.gradcheck import check_model

    from ringtrain_trainer.engine import model as M

    lstm = {"class_name": "LSTM", "config": {"units": 3, "return_sequences": True}}
    spec = KM.from_config(
        _graph(
            (5,),
            [
                ("Embedding", "e", {"input_dim": 7, "output_dim": 4}, ["inp"], {}),
                ("MultiHeadAttention", "a", {"num_heads": 2, "key_dim": 3}, ["e", "e"], {}),
                ("Add", "r", {}, ["e", "a"], {}),
                ("LayerNormalization", "n", {}, ["r"], {}),
                ("Bidirectional", "b", {"layer": lstm}, ["n"], {}),
                ("GRU", "g", {"units": 3}, ["b"], {}),
                ("Dense", "d", {"units": 3}, ["g"], {}),
            ],
        )
    )
    flat = spec.init(3, np.float64) + rng.normal(0, 0.2, spec.num_params)
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = M.Program(spec, 3, True, np.float64, grads_first=grads_first)
    prog.x[:] = rng.integers(0, 7, prog.x.shape)
    prog.labels[:] = rng.integers(0, 3, 3)

    def loss():
        return prog.loss_and_dlogits(prog.forward(views))

    loss()
    for _ in prog.backward_pieces(views, gviews):
        pass
    check_model(spec, flat, grad, loss, rng, samples=8)
