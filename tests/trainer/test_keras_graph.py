"""Functional configs through the one Keras front end, without TensorFlow: both JSON formats
parse to one graph, fan-out and merges match finite differences, unsupported graph features are
refused naming them, and the documentation's layer table (docs/layers.md) is the registry's."""

from pathlib import Path

import pytest
from test_keras_layers import fd_check

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.fused import ConvPool
from ringtrain_trainer.engine.ops.merge import Concatenate, Merge
from ringtrain_trainer.keras import config as K
from ringtrain_trainer.keras import load as KM
from ringtrain_trainer.keras import registry

LAYERS_PAGE = Path(__file__).resolve().parents[2] / registry.PAGE


def functional(shape, layers, out, fmt="k3", inputs=("in",), outputs=None):
    """A Functional config: ``layers`` as (class, name, [input layer names], config)."""

    def ref(name):
        if fmt == "k3":
            hist = [name, 0, 0]
            return {"class_name": "__keras_tensor__", "config": {"keras_history": hist}}
        return [name, 0, 0, {}]

    items = [
        {
            "class_name": "InputLayer",
            "name": name,
            "config": {"name": name, "batch_shape": [None, *shape]},
            "inbound_nodes": [],
        }
        for name in inputs
    ]
    for cls, name, ins, cfg in layers:
        refs = [ref(i) for i in ins]
        k3 = {"args": [refs if len(refs) > 1 else refs[0]], "kwargs": {}}
        node = k3 if fmt == "k3" else refs
        items.append(
            {
                "class_name": cls,
                "name": name,
                "config": {"name": name, **cfg},
                "inbound_nodes": [node],
            }
        )
    outs = outputs or [out]
    return {
        "class_name": "Functional",
        "config": {
            "name": "f",
            "layers": items,
            "input_layers": [[i, 0, 0] for i in inputs],
            "output_layers": [[o, 0, 0] for o in outs],
        },
        "compile_config": {
            "loss": {"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}}
        },
    }


#: a residual block (the Add reads "a" twice over two paths) and branches joined by merges
RESIDUAL = [
    ("Dense", "a", ["in"], {"units": 5, "activation": "tanh"}),
    ("Dense", "b", ["a"], {"units": 5}),
    ("BatchNormalization", "bn", ["b"], {}),
    ("Add", "add", ["a", "bn"], {}),
    ("Dense", "c", ["add"], {"units": 4, "activation": "sigmoid"}),
    ("Dense", "d", ["a"], {"units": 4}),
    ("Multiply", "mul", ["c", "d"], {}),
    ("Maximum", "max", ["mul", "d", "c"], {}),
    ("Subtract", "sub", ["max", "c"], {}),
    ("Concatenate", "cat", ["sub", "a", "mul"], {}),
    ("Average", "avg", ["cat", "cat"], {}),
    ("Dense", "out", ["avg"], {"units": 3}),
]


def test_tf_keras_2_and_keras_3_functional_configs_parse_alike():
    a = K.parse(functional((4,), RESIDUAL, "out"))
    b = K.parse(functional((4,), RESIDUAL, "out", fmt="tf2"))
    assert a.layers == b.layers and a.functional and a.input_shape == (4,)
    names = {0: "in", **{s.output: s.name for s in a.layers}}
    add = next(s for s in a.layers if s.cls == "Add")
    assert [names[t] for t in add.inputs] == ["a", "bn"]
    assert sorted(s.name for s in a.consumers(add.inputs[0])) == ["add", "b", "cat", "d"]
    assert next(s for s in a.layers if s.cls == "Concatenate").out_shape == (13,)


@pytest.mark.parametrize("grads_first", [False, True])
def test_fan_out_and_every_merge_match_finite_differences(grads_first, rng):
    spec = KM.from_config(functional((4,), RESIDUAL, "out"))
    kinds = {type(op) for op in spec.layers}
    assert {Merge, Concatenate} <= kinds
    assert spec.graph.fanned_out()  # "a", "c", "d", "mul", "cat" are read more than once
    fd_check(spec, rng, grads_first=grads_first)


def test_sequential_stays_a_chain_and_a_functional_conv_pool_fuses_only_alone():
    cnn = KM.load("cnn")
    assert [n.inputs for n in cnn.graph.nodes] == [(0,), (1,), (2,)]
    conv = ("Conv2D", "c", ["in"], {"filters": 2, "kernel_size": 3, "activation": "relu"})
    pool = ("MaxPooling2D", "p", ["c"], {})
    tail = [("Flatten", "f", ["p"], {}), ("Dense", "out", ["f"], {"units": 3})]
    alone = KM.from_config(functional((6, 6, 1), [conv, pool, *tail], "out"))
    assert isinstance(alone.layers[0], ConvPool) and alone.layers[0].name == "c+p"
    shared = [conv, pool, ("MaxPooling2D", "q", ["c"], {}), ("Add", "s", ["p", "q"], {}), *tail]
    shared[4] = ("Flatten", "f", ["s"], {})
    spec = KM.from_config(functional((6, 6, 1), shared, "out"))
    assert not any(isinstance(op, ConvPool) for op in spec.layers)


def _called_twice():
    """A tf.keras 2 layer called twice (Keras 3 shared layers run: test_keras_nested.py)."""
    cfg = functional((4,), [("Dense", "d", ["in"], {"units": 3})], "d", fmt="tf2")
    layer = cfg["config"]["layers"][1]
    layer["inbound_nodes"] = layer["inbound_nodes"] * 2
    return cfg


def _kwargs(**kw):
    cfg = functional((4,), [("Dense", "d", ["in"], {"units": 3})], "d")
    cfg["config"]["layers"][1]["inbound_nodes"][0]["kwargs"] = kw
    return cfg


def _positional(value):
    cfg = functional((4,), [("Dense", "d", ["in"], {"units": 3})], "d")
    node = cfg["config"]["layers"][1]["inbound_nodes"][0]
    node["args"] = [*node["args"], value]
    return cfg


@pytest.mark.parametrize(
    "cfg, words",
    [
        (_called_twice(), "layer 'd' (Dense) is called 2 times: shared layers are not supported"),
        (
            functional(
                (4,),
                [("Dense", "a", ["in"], {"units": 3}), ("Dense", "b", ["a"], {"units": 3})],
                "a",
                outputs=["a", "b"],
            ),
            "output 'a' is also read by ['b']",
        ),
        (
            functional(
                (4,),
                [("Dense", "a", ["in"], {"units": 3}), ("Dense", "b", ["in"], {"units": 3})],
                "a",
                outputs=["a", "a"],
            ),
            "output 'a' is named twice",
        ),
        (_kwargs(training=True), "layer 'd' (Dense): call argument training=True"),
        (_positional(True), "layer 'd' (Dense): call argument True is not supported"),
        (
            functional((4,), [("Dense", "d", ["ghost"], {"units": 3})], "d"),
            "layer 'd' (Dense) reads ['ghost', 0, 0], which no layer of the model writes",
        ),
        (
            functional((4,), [("Subtract", "s", ["in", "in", "in"], {})], "s"),
            "Subtract takes exactly 2 inputs",
        ),
        (
            functional(
                (4,), [("Dense", "d", ["in"], {"units": 3}), ("Add", "s", ["in", "d"], {})], "s"
            ),
            "layer 's' (Add): inputs of shapes (4,), (3,) are not supported",
        ),
        (
            functional((4,), [("Add", "s", ["in"], {})], "s"),
            "layer 's' (Add): called on 1 tensors (supported: 2 or more)",
        ),
        (
            functional((4,), [("Dense", "d", ["in", "in"], {"units": 3})], "d"),
            "layer 'd' (Dense): called on 2 tensors (supported: 1)",
        ),
        (
            functional((4,), [("Concatenate", "c", ["in", "in"], {"axis": 0})], "c"),
            "layer 'c' (Concatenate): axis=0 is not supported",
        ),
        (
            functional((4,), [("Lambda", "l", ["in"], {})], "l"),
            "layer 'l' (Lambda) is not supported (supported layers: InputLayer, Conv2D",
        ),
    ],
)
def test_unsupported_functional_features_are_refused_naming_them(cfg, words):
    with pytest.raises(InvalidSpec) as e:
        KM.from_config(cfg)
    assert words in str(e.value)


def test_the_layer_page_lists_every_registered_layer_from_the_registry():
    assert all(e.doc for e in registry.REGISTRY.values())
    text = LAYERS_PAGE.read_text()
    assert registry.with_table(text) == text, (
        "docs/layers.md's layer table is stale: run "
        "PYTHONPATH=trainer .venv/bin/python -m ringtrain_trainer.keras.registry docs/layers.md"
    )
