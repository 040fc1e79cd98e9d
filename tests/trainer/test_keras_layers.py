"""Keras-config models on the IPU: every layer against finite differences, refusals, state rules.

The comparisons with real Keras live in ``test_keras_reference.py`` (TensorFlow is slow to
import); these tests need only numpy.
"""

import json

import numpy as np
import pytest
from support.gradcheck import check_model

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer.engine import handwritten
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops import fused
from ringtrain_trainer.engine.ops.dropout import masks
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.keras import config as K
from ringtrain_trainer.keras import load as KM
from ringtrain_trainer.keras import load as keras_load


def layer(cls, name=None, **cfg):
    return {"class_name": cls, "config": {"name": name or cls.lower(), **cfg}}


def seq(shape, *layers, from_logits=None):
    model = {
        "class_name": "Sequential",
        "config": {
            "name": "t",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_input_shape": [None, *shape]}},
                *layers,
            ],
        },
    }
    if from_logits is not None:
        model["compile_config"] = {
            "loss": {
                "class_name": "SparseCategoricalCrossentropy",
                "config": {"from_logits": from_logits},
            }
        }
    return model


#: every supported layer, with strides, 'same' padding and activations, folded softmax
WIDE = seq(
    (7, 7, 2),
    layer(
        "Conv2D", "c1", filters=3, kernel_size=[3, 2], strides=2, padding="same", activation="tanh"
    ),
    layer("BatchNormalization", "bn1"),
    layer("MaxPooling2D", "mp", pool_size=2, strides=1, padding="same"),
    layer("Conv2D", "c2", filters=2, kernel_size=2, activation="sigmoid", use_bias=False),
    layer("ReLU", "r"),
    layer("AveragePooling2D", "ap", pool_size=2, padding="same"),
    layer("Flatten", "f"),
    layer("Dropout", "d", rate=0.5),
    layer("Dense", "d1", units=4, activation="tanh"),
    layer("Dense", "d2", units=3, activation="softmax"),
)
#: the fused fast path after Reshape/Rescaling, global pooling, softmax as a layer
NARROW = seq(
    (6, 6),
    layer("Reshape", "rs", target_shape=[6, 6, 1]),
    layer("Rescaling", "sc", scale=0.5, offset=0.1),
    layer("Conv2D", "c", filters=4, kernel_size=3, activation="relu"),
    layer("MaxPooling2D", "p"),
    layer("Conv2D", "c3", filters=3, kernel_size=1, activation="linear"),
    layer("GlobalAveragePooling2D", "g"),
    layer("Dense", "d1", units=5, activation="relu", use_bias=False),
    layer("Activation", "a", activation="softmax"),
    layer("BatchNormalization", "bn", center=False),
    layer("Dense", "d2", units=3),
    layer("Softmax", "sm"),
    from_logits=True,
)


def fd_check(spec, rng, batch=3, dtype=np.float64, samples=10, grads_first=False):
    flat = spec.init(3, dtype) + rng.normal(0, 0.05, spec.num_params)
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = M.Program(spec, batch, True, dtype, grads_first=grads_first)
    prog.ctx.update(seed=5, step=2)
    prog.x[:] = rng.random(prog.x.shape)
    prog.labels[:] = rng.integers(0, spec.num_classes, batch)

    def loss():
        return prog.loss_and_dlogits(prog.forward(views))

    loss()
    for _ in prog.backward_pieces(views, gviews):  # the production path, drained
        pass
    check_model(spec, flat, grad, loss, rng, samples)


@pytest.mark.parametrize("grads_first", [False, True])
@pytest.mark.parametrize("config", [WIDE, NARROW], ids=["wide", "narrow"])
def test_every_layer_matches_finite_differences(config, grads_first, rng):
    fd_check(KM.from_config(config), rng, grads_first=grads_first)


def test_the_wide_model_uses_the_general_layers_and_the_narrow_one_the_fused_conv():
    wide, narrow = KM.from_config(WIDE), KM.from_config(NARROW)
    assert [type(x).__name__ for x in wide.layers] == [
        "Conv",  # the engine's one convolution op (engine/ops/conv.py)
        "BatchNorm",
        "Pool",
        "Conv",
        "Act",  # ReLU: the activation table's op
        "Pool",
        "Reshape",
        "Dropout",
        "Dense",  # the general path (a softmax- or tanh-style activation): "Linear" before
        "Dense",  # the fast path (relu/linear with a bias on a flat input)
    ]
    assert not wide.layers[8].fast and wide.layers[9].fast
    assert isinstance(narrow.layers[1], fused.ConvPool) and narrow.layers[1].name == "c+p"
    assert narrow.input_shape == (6, 6, 1) and narrow.config.input_shape == (6, 6)
    assert not wide.config.from_logits and narrow.config.from_logits


def test_presets_are_the_hand_written_models_layout_and_numbers(rng):
    for name in ("cnn", "cnn2"):
        spec, hand = keras_load.build(name), handwritten.build(name)
        assert [type(x) for x in spec.layers] == [type(x) for x in hand.layers]
        assert [(s.spec, s.start) for s in spec.slots] == [(s.spec, s.start) for s in hand.slots]
        assert spec.grad_pieces == hand.grad_pieces
        flat = spec.init(7)
        np.testing.assert_array_equal(flat, hand.init(7))
        a, b = M.Program(spec, 4, True), M.Program(hand, 4, True)
        a.x[:] = b.x.reshape(a.x.shape)[:] = rng.random(a.x.shape)
        np.testing.assert_array_equal(a.forward(spec.views(flat)), b.forward(hand.views(flat)))


def test_glorot_kernels_and_batchnorm_ones_and_zeros():
    spec = KM.from_config(WIDE)
    flat, v = spec.init(0), spec.views(spec.init(0))
    bn = v[1]
    np.testing.assert_array_equal(bn["gamma"], 1)
    np.testing.assert_array_equal(bn["beta"], 0)
    np.testing.assert_array_equal(v[0]["bias"], 0)
    limit = np.sqrt(6 / (3 * 2 * 2 + 3 * 2 * 3))
    assert np.abs(v[0]["kernel"]).max() <= limit and np.abs(v[0]["kernel"]).std() > limit / 5
    assert flat.dtype == np.float32
    state = spec.state_views(spec.init_state())[1]
    np.testing.assert_array_equal(state["moving_mean"], 0)
    np.testing.assert_array_equal(state["moving_variance"], 1)


@pytest.mark.parametrize(
    "bad, words",
    [
        (
            layer("Conv2D", "cx", filters=2, kernel_size=3, strides=2, dilation_rate=2),
            "layer 'cx' (Conv2D): dilation_rate=[2, 2] is not supported (supported: 1 when strides",
        ),
        (
            layer("Conv2D", "cx", filters=2, kernel_size=3, data_format="channels_first"),
            "layer 'cx' (Conv2D): data_format='channels_first'",
        ),
        (layer("Conv2D", "cx", filters=2, kernel_size=3, groups=2), "groups=2"),
        (
            layer("Conv2D", "cx", filters=2, kernel_size=3, padding="causal"),
            "padding='causal' is not supported (supported: 'valid' or 'same')",
        ),
        (
            layer("Dense", "dx", units=3, kernel_regularizer={"class_name": "Orthogonal"}),
            "layer 'dx' (Dense): kernel_regularizer=",
        ),
        (
            layer(
                "Dense", "dx", units=3, activity_regularizer={"class_name": "OrthogonalRegularizer"}
            ),
            "layer 'dx' (Dense): activity_regularizer=",
        ),
        (
            layer("Dense", "dx", units=3, activation="sparsemax"),
            "activation='sparsemax' is not supported (supported: linear, relu, relu6,",
        ),
        (layer("Dense", "dx", units=3, kernel_initializer="my_init"), "kernel_initializer"),
        (
            layer("ConvLSTM2D", "lx", filters=3),
            "layer 'lx' (ConvLSTM2D) is not supported (supported layers: ",
        ),
        (layer("BatchNormalization", "bx", axis=1), "layer 'bx' (BatchNormalization): axis=1"),
        (layer("BatchNormalization", "bx", synchronized=True), "synchronized=True"),
        (
            layer("Dense", "dx", units=3, mystery=1),
            "layer 'dx' (Dense): mystery=1 is not supported",
        ),
    ],
)
def test_unsupported_layers_and_arguments_are_refused_naming_them(bad, words):
    with pytest.raises(InvalidSpec) as e:
        KM.from_config(seq((8, 8, 1), bad, layer("Flatten"), layer("Dense", units=2)))
    assert words in str(e.value)


def test_a_frozen_model_is_refused_and_frozen_layers_are_held_as_state():
    m = seq((8, 8, 1), layer("Flatten", trainable=False), layer("Dense", units=2))
    assert KM.from_config(m).num_params == 8 * 8 * 2 + 2  # nothing to freeze
    m["config"]["trainable"] = False
    with pytest.raises(InvalidSpec, match="model: trainable=False is not supported"):
        KM.from_config(m)
    frozen = layer("Conv2D", "cx", filters=2, kernel_size=3, trainable=False)
    bn = layer("BatchNormalization", "bx", trainable=False)
    cfg = seq((8, 8, 1), frozen, bn, layer("Flatten"), layer("Dense", units=2))
    with pytest.raises(InvalidSpec, match=r"'cx' \(Conv2D\): trainable=False needs starting"):
        KM.from_config(cfg)  # a config brings no weights: they would stay random
    spec = KM.KerasModel("m", K.parse(cfg))
    assert (spec.num_params, spec.num_frozen) == (6 * 6 * 2 * 2 + 2, 3 * 3 * 2 + 2 + 2 * 2)
    every = seq((4,), layer("Dense", "dx", units=2, trainable=False))
    with pytest.raises(InvalidSpec, match="every weight of the model is frozen"):
        KM.KerasModel("m", K.parse(every))


def test_shape_and_loss_mistakes_are_refused_before_anything_runs():
    # Dense runs on any rank (the last axis, as Keras); one unit is no classifier's output
    with pytest.raises(InvalidSpec, match=r"the output shape is \(8, 8, 1\); a classifier needs"):
        KM.from_config(seq((8, 8, 1), layer("Dense", "dd", units=1)))
    with pytest.raises(InvalidSpec, match="from_logits=False needs a model whose last layer"):
        KM.from_config(seq((4,), layer("Dense", units=2), from_logits=False))
    with pytest.raises(
        InvalidSpec, match="a Keras Sequential or Functional config is needed, got 'MyModel'"
    ):
        KM.from_config({"class_name": "MyModel", "config": {}})
    with pytest.raises(InvalidSpec, match="--model: unknown model 'vgg'"):
        keras_load.build("vgg")


def test_dropout_masks_depend_on_the_global_example_not_on_how_the_batch_is_split():
    """Rule: the mask of global example e at step s is a function of (seed, layer, s, e) only,
    so N workers with batch B draw exactly one worker's masks for batch N·B."""
    whole = np.zeros((8, 5), np.float32)
    masks(9, 3, 4, 0, 0.4, whole)
    parts = np.zeros((2, 4, 5), np.float32)
    for r in range(2):
        masks(9, 3, 4, 4 * r, 0.4, parts[r])
    np.testing.assert_array_equal(parts.reshape(8, 5), whole)
    assert set(np.unique(whole)) == {0, np.float32(1 / 0.6)}
    other = np.zeros_like(whole)
    masks(9, 3, 5, 0, 0.4, other)
    assert not np.array_equal(other, whole)


def _ipu(spec, replicas=1, threads=1, rank=0, memory=900 * MB):
    params = spec.init(1)
    return IPU(
        spec,
        IPUConfig(memory_bytes=memory, replicas=replicas, host_threads=threads, rank=rank, seed=4),
        params,
        np.zeros_like(params),
    )


def test_workers_with_dropout_and_batchnorm_equal_replicas_of_one_worker(rng):
    """2 workers x 1 replica x batch 4 (ring-averaged gradients) == 1 worker x 2 replicas x 4:
    dropout masks follow the global example and batch statistics are per replica."""
    spec = KM.from_config(WIDE)
    x = rng.random((8, 7, 7, 2)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    one = _ipu(spec, replicas=2)
    one.train_step(one.compile(8), x, y, step=3)
    workers = [_ipu(spec, rank=r) for r in range(2)]
    for r, w in enumerate(workers):
        w.train_step(w.compile(4), x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4], step=3)
    ring = (workers[0].host_grads + workers[1].host_grads) / 2
    np.testing.assert_allclose(one.host_grads, ring, rtol=1e-5, atol=1e-7)


def test_batchnorm_statistics_are_per_replica_and_host_threads_do_not_change_them(rng):
    spec = KM.from_config(WIDE)
    x = rng.random((8, 7, 7, 2)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    a, b = _ipu(spec, replicas=2, threads=1), _ipu(spec, replicas=2, threads=4)
    for ipu in (a, b):
        ipu.train_step(ipu.compile(8), x, y, step=0)
    np.testing.assert_array_equal(a.host_grads, b.host_grads)


def test_moving_statistics_are_the_mean_of_each_replicas_update(rng):
    """Each replica updates its copy with its own batch's mean and (biased) variance; after the
    step the worker keeps the mean of the copies (Keras' ON_READ/MEAN), and so do they."""
    spec = KM.from_config(
        seq((4,), layer("BatchNormalization", "bn", momentum=0.9), layer("Dense", units=3))
    )
    x = rng.random((8, 4)).astype(np.float32)
    ipu = _ipu(spec, replicas=2, threads=2)
    exe = ipu.compile(8)
    ipu.train_step(exe, x, rng.integers(0, 3, 8))
    halves = x.reshape(2, 4, 4)
    st = spec.state_views(ipu.state)[0]
    np.testing.assert_allclose(st["moving_mean"], 0.1 * halves.mean(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(st["moving_variance"], 0.9 + 0.1 * halves.var(1).mean(0), rtol=1e-5)
    for p in exe.programs:
        np.testing.assert_array_equal(p.state, ipu.state)
    # evaluation reads the worker's statistics
    assert ipu.compile(8, train=False).programs[0].state is ipu.state


def test_out_of_memory_names_the_largest_layers():
    spec = KM.from_config(WIDE)
    with pytest.raises(IPUCompileError, match=r"largest layers: c1 [\d,]+, "):
        _ipu(spec, memory=1 << 16).compile(256)
    plan = _ipu(spec).plan(16, True)
    assert next(n for n, _ in plan.layers) == "c1"
    assert sum(b for _, b in plan.layers) <= plan.total


def test_tf_keras_2_and_keras_3_configs_parse_alike():
    k3 = KM.preset_config("cnn")
    k2 = {
        "class_name": "Sequential",
        "config": {
            "name": "cnn",
            "layers": [
                {
                    "class_name": "InputLayer",
                    "config": {
                        "batch_input_shape": [None, 28, 28],
                        "dtype": "float32",
                        "sparse": False,
                        "ragged": False,
                        "name": "input_1",
                    },
                },
                layer("Reshape", "reshape", target_shape=[28, 28, 1], dtype="float32"),
                layer(
                    "Conv2D",
                    "conv2d",
                    filters=32,
                    kernel_size=[3, 3],
                    activation="relu",
                    kernel_initializer={"class_name": "GlorotUniform", "config": {"seed": None}},
                    bias_initializer={"class_name": "Zeros", "config": {}},
                ),
                layer("MaxPooling2D", "max_pooling2d", pool_size=[2, 2], strides=[2, 2]),
                layer("Flatten", "flatten"),
                layer("Dense", "dense", units=64, activation="relu"),
                layer("Dense", "dense_1", units=10),
            ],
        },
        "keras_version": "2.15.0",
    }
    a, b = K.parse(k3), K.parse(k2)
    assert a.layers == b.layers and a.input_shape == b.input_shape == (28, 28)
    assert a.from_logits and b.from_logits


def test_weights_round_trip_in_get_weights_order():
    spec = KM.from_config(WIDE)
    flat = spec.init(2)
    state = spec.init_state() + 0.5
    w = spec.keras_weights(flat, state)
    assert [a.shape for a in w] == [
        (3, 2, 2, 3),
        (3,),
        (3,),
        (3,),
        (3,),
        (3,),
        (2, 2, 3, 2),
        (8, 4),
        (4,),
        (4, 3),
        (3,),
    ]
    f2, s2 = spec.from_keras_weights(w)
    np.testing.assert_array_equal(f2, flat)
    np.testing.assert_array_equal(s2, state)
    assert [g for _, g in spec.h5_groups()][:4] == [
        "layers/conv2d",
        "layers/batch_normalization",
        "layers/max_pooling2d",
        "layers/conv2d_1",
    ]


def test_the_worker_trains_a_keras_json_with_dropout_and_batchnorm(tmp_path, capsys):
    from ringtrain_trainer import worker_main

    path = tmp_path / "model.json"
    path.write_text(
        json.dumps(
            seq(
                (28, 28),
                layer("Reshape", "r", target_shape=[28, 28, 1]),
                layer("Conv2D", "c", filters=8, kernel_size=3, strides=2, activation="relu"),
                layer("BatchNormalization", "bn"),
                layer("MaxPooling2D", "p"),
                layer("Flatten", "f"),
                layer("Dropout", "d", rate=0.25),
                layer("Dense", "out", units=10, activation="softmax"),
            )
        )
    )
    rc = worker_main.main(
        [
            "--dataset",
            "mnist-5k",
            "--model",
            str(path),
            "--steps",
            "120",
            "--json",
            "--termination-log",
            "",
            "--ipus-per-worker",
            "2",
        ]
    )
    assert rc == 0
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert final["test_accuracy"] >= 0.6  # chance is 0.10


def test_the_worker_refuses_an_unsupported_keras_json_before_running(tmp_path, capsys):
    from ringtrain.errors import EXIT_PERMANENT
    from ringtrain_trainer import worker_main

    path = tmp_path / "model.json"
    path.write_text(json.dumps(seq((28, 28), layer("ConvLSTM2D", "rnn_1", filters=3))))
    assert worker_main.main(["--model", str(path), "--termination-log", ""]) == EXIT_PERMANENT
    assert "layer 'rnn_1' (ConvLSTM2D) is not supported" in capsys.readouterr().err


def test_moving_statistics_are_checkpointed_and_restored(tmp_path, mnist5k):
    from ringtrain_trainer import worker
    from ringtrain_trainer.checkpoint.store import CheckpointManager
    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.config import TrainerConfig

    path = tmp_path / "bn.json"
    path.write_text(
        json.dumps(
            seq(
                (28, 28),
                layer("Flatten", "f"),
                layer("BatchNormalization", "bn"),
                layer("Dense", "out", units=10),
            )
        )
    )
    cfg = TrainerConfig(
        dataset="mnist-5k", model=str(path), steps=3, checkpoint_dir=str(tmp_path / "ck")
    )
    first = worker.Trainer(cfg, LocalCollective(), mnist5k)
    try:
        first.run()
        trained = first.ipu.state.copy()
    finally:
        first.close()
    saved = CheckpointManager(tmp_path / "ck").load_latest()[0].model_state
    np.testing.assert_array_equal(saved, trained)
    assert not np.allclose(saved[:784], 0)  # the moving mean moved
    again = worker.Trainer(cfg, LocalCollective(), mnist5k)
    try:
        again._restore()
        np.testing.assert_array_equal(again.ipu.state, trained)
        assert all(np.array_equal(p.state, trained) for p in again.exe.programs)
    finally:
        again.close()


def test_the_worker_takes_model_to_json_text_itself_and_export_rebuilds_it_from_the_checkpoint(
    tmp_path, capsys
):
    """How the operator passes an inline spec.trainer.model: --model is the JSON text; the
    checkpoint records it, so ``ringtrain export`` needs nothing else."""
    from ringtrain_trainer import worker_main
    from ringtrain_trainer.export import cli as export_cli
    from ringtrain_trainer.export import read_keras

    text = json.dumps(
        seq(
            (28, 28),
            layer("Flatten", "f"),
            layer("Dropout", "d", rate=0.1),
            layer("Dense", "out", units=10),
        ),
        separators=(",", ":"),
    )
    rc = worker_main.main(
        [
            "--dataset",
            "mnist-5k",
            "--model",
            text,
            "--steps",
            "3",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--termination-log",
            "",
        ]
    )
    assert rc == 0
    assert export_cli.main([str(tmp_path / "ck"), "-o", str(tmp_path / "m.keras")]) == 0
    assert "model inline Keras config 't'" in capsys.readouterr().out
    config, weights = read_keras(tmp_path / "m.keras")
    assert [x["class_name"] for x in config["config"]["layers"]][1:] == [
        "Flatten",
        "Dropout",
        "Dense",
    ] and [w.shape for w in weights] == [(784, 10), (10,)]


def test_the_worker_refuses_inline_text_that_is_not_json(capsys):
    from ringtrain.errors import EXIT_PERMANENT
    from ringtrain_trainer import worker_main

    assert (
        worker_main.main(["--model", "{'class_name': 'Sequential'}", "--termination-log", ""])
        == EXIT_PERMANENT
    )
    assert "--model: inline Keras config is not JSON" in capsys.readouterr().err
