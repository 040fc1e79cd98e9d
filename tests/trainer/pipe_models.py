"""Small Keras configs for the pipelining and recomputation tests (no TensorFlow needed)."""

from __future__ import annotations

import json

import numpy as np


def layer(cls: str, **config) -> dict:
    return {"class_name": cls, "config": config}


def conv_stack(convs: int = 4, filters: int = 16, dropout: bool = False) -> dict:
    """Same-padded 3x3 convolutions: their im2col workspaces dominate the memory plan, and
    every layer boundary is a place to cut."""
    body = [
        layer(
            "Conv2D",
            name=f"conv{i}",
            filters=filters,
            kernel_size=[3, 3],
            padding="same",
            activation="relu",
        )
        for i in range(1, convs + 1)
    ]
    if dropout:
        body.insert(2, layer("Dropout", name="drop", rate=0.25))
    return {
        "class_name": "Sequential",
        "config": {
            "name": "conv_stack",
            "layers": [
                layer("InputLayer", batch_input_shape=[None, 28, 28], name="in"),
                layer("Reshape", name="reshape", target_shape=[28, 28, 1]),
                *body,
                layer("MaxPooling2D", name="pool", pool_size=[2, 2]),
                layer("Flatten", name="flatten"),
                layer("Dense", name="dense", units=10),
            ],
        },
    }


def residual() -> dict:
    """A functional model with a residual Add: only the cuts between blocks are single-tensor."""

    def node(cls, name, inputs, **config):
        return {
            "class_name": cls,
            "name": name,
            "config": {"name": name, **config},
            "inbound_nodes": [[[i, 0, 0, {}] for i in inputs]] if inputs else [],
        }

    return {
        "class_name": "Functional",
        "config": {
            "name": "residual",
            "layers": [
                node("InputLayer", "in", [], batch_input_shape=[None, 28, 28]),
                node("Flatten", "flatten", ["in"]),
                node("Dense", "d1", ["flatten"], units=32, activation="relu"),
                node("Dense", "d2", ["d1"], units=32, activation="relu"),
                node("Add", "add", ["d1", "d2"]),
                node("Dense", "d3", ["add"], units=32, activation="tanh"),
                node("Dense", "out", ["d3"], units=10),
            ],
            "input_layers": [["in", 0, 0]],
            "output_layers": [["out", 0, 0]],
        },
    }


def text(cfg: dict) -> str:
    return json.dumps(cfg)


def sgd_on_ipu(spec, cfg, steps: int, batch: int, lr: float):
    """``steps`` plain-SGD steps of ``spec`` on one emulated IPU (``ipu.IPU``) over seeded random
    images: (params, losses, executable, ipu) — the runs the recompute and workspace-cap tests
    compare with and without their option."""
    from ringtrain_trainer.ipu.device import IPU

    params = spec.init(5)
    grads = np.zeros_like(params)
    ipu = IPU(spec, cfg, params, grads)
    exe = ipu.compile(batch)
    rng = np.random.default_rng(2)
    losses = []
    for step in range(steps):
        x = rng.random((batch, 28, 28, 1), np.float32)
        losses.append(ipu.train_step(exe, x, rng.integers(0, 10, batch), step=step))
        params -= lr * grads
    ipu.close()
    return params, losses, exe, ipu
