"""Several outputs and inputs without TensorFlow: the packed loss and a whole two-input
two-output model against the shared finite-difference check, and the packed buffers' rules."""

import numpy as np
import pytest
from support.gradcheck import check_model, gradcheck

from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.loss_spec import LossSpec
from ringtrain_trainer.engine.losses import Loss
from ringtrain_trainer.engine.multiloss import Head, MultiLoss, MultiLossSpec
from ringtrain_trainer.keras import load as KM

SPARSE = LossSpec("SparseCategoricalCrossentropy", {"from_logits": True})
MSE = LossSpec("MeanSquaredError")
BINARY = LossSpec("BinaryCrossentropy", {"from_logits": True})


def test_the_packed_loss_is_keras_weighted_sum_and_its_gradient_matches_finite_differences():
    spec = MultiLossSpec(
        (Head("a", SPARSE, 0.5, 3), Head("b", MSE, 2.0, 2), Head("c", None, 1.0, 2),
         Head("d", BINARY, 1.0, 1))
    )  # fmt: skip
    rng = np.random.default_rng(0)
    batch = 4
    loss = MultiLoss(spec, batch, np.float64)
    z = rng.normal(size=(batch, 8))
    loss.labels[:, 0] = rng.integers(0, 3, batch)
    loss.labels[:, 1:3] = rng.normal(size=(batch, 2))
    loss.labels[:, 3] = rng.integers(0, 2, batch)
    total = loss.step(z)
    assert loss.labels.shape == (batch, 4)  # 1 class id + 2 targets + nothing for c + 1 label
    singles = []
    for h, (a, b), (la, lb) in zip(spec.heads, loss.cols, loss.lcols, strict=True):
        if h.loss is None:
            continue
        s = Loss(h.loss, batch, h.width, np.float64)
        y = loss.labels[:, la:lb]
        s.labels[...] = y[:, 0] if s.labels.ndim == 1 else y
        singles.append(h.weight * s.step(np.ascontiguousarray(z[:, a:b])))
    assert total == pytest.approx(sum(singles), rel=1e-12)
    analytic = np.concatenate(loss.blocks, axis=1)
    assert not analytic[:, 5:7].any()  # loss None: no gradient from that output
    gradcheck(lambda: loss.step(z), z, analytic, what="MultiLoss")


def _two_in_two_out() -> dict:
    def layer(cls, name, inputs, **cfg):
        hist = [
            {"class_name": "__keras_tensor__", "config": {"keras_history": [i, 0, 0]}}
            for i in inputs
        ]
        return {
            "class_name": cls,
            "name": name,
            "config": {"name": name, **cfg},
            "inbound_nodes": [{"args": [hist if len(hist) > 1 else hist[0]], "kwargs": {}}],
        }

    def inp(name, shape):
        cfg = {"name": name, "batch_shape": [None, *shape]}
        return {"class_name": "InputLayer", "name": name, "config": cfg, "inbound_nodes": []}

    return {
        "class_name": "Functional",
        "config": {
            "name": "two",
            "layers": [
                inp("t", (5,)),
                inp("i", (4, 4, 2)),
                layer("Dense", "dt", ["t"], units=4, activation="tanh"),
                layer("Conv2D", "c", ["i"], filters=2, kernel_size=3, activation="relu"),
                layer("Flatten", "f", ["c"]),
                layer("Concatenate", "cat", ["dt", "f"]),
                layer("Dense", "cls", ["cat"], units=3, activation="softmax"),
                layer("Dense", "reg", ["cat", ], units=2),
            ],
            "input_layers": [["t", 0, 0], ["i", 0, 0]],
            "output_layers": [["cls", 0, 0], ["reg", 0, 0]],
        },
        "compile_config": {
            "loss": {"cls": "sparse_categorical_crossentropy", "reg": "huber"},
            "loss_weights": [1.0, 0.7],
        },
    }  # fmt: skip


def test_a_two_input_two_output_model_matches_finite_differences():
    spec = KM.from_config(_two_in_two_out())
    assert spec.input_shape == (5 + 32,) and spec.num_classes == 5
    rng = np.random.default_rng(1)
    batch = 3
    flat = spec.init(3, np.float64) + rng.normal(0, 0.05, spec.num_params)
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = M.Program(spec, batch, True, np.float64)
    prog.x[:] = rng.random(prog.x.shape)
    prog.labels[:, 0] = rng.integers(0, 3, batch)
    prog.labels[:, 1:] = rng.normal(size=(batch, 2))

    def loss():
        return prog.loss_and_dlogits(prog.forward(views))

    loss()
    for _ in prog.backward_pieces(views, gviews):
        pass
    check_model(spec, flat, grad, loss, rng, samples=8)
