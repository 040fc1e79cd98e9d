"""The seeds' CNNs written by hand from the fused ops, the reference the Keras presets are held to.

Pipeline position: tests and benchmarks only. ``keras.load`` builds the shipped presets from their
Keras configs; these two are the same networks assembled directly (test_keras_layers.py
checks both give the same parameters and steps).
"""

from __future__ import annotations

import math

from ringtrain import options
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.model import ModelSpec
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.fused import ConvPool

MODELS = options.MODELS


def build(name: str) -> ModelSpec:
    """``cnn``: the seeds' CNN; ``cnn2``: the TensorFlow tutorial's two-conv variant."""
    if name == "cnn":
        c1 = ConvPool((28, 28, 1), 32)
        flat = math.prod(c1.out_shape)
        return ModelSpec(name, [c1, Dense((flat,), 64, "relu"), Dense((64,), 10)])
    if name == "cnn2":
        c1 = ConvPool((28, 28, 1), 32)
        h, w, c = c1.out_shape
        c2 = ConvPool((h, w, c), 64)
        flat = math.prod(c2.out_shape)
        return ModelSpec(name, [c1, c2, Dense((flat,), 64, "relu"), Dense((64,), 10)])
    raise InvalidSpec(f"--model: unknown model {name!r} (known: {', '.join(MODELS)})")
