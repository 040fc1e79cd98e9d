"""``ringtrain export CHECKPOINT_OR_DIR -o model.keras [--format keras|onnx]``.

Pipeline position: after training. A checkpoint (its ``ckpt-*.json`` manifest) or a checkpoint
directory — meaning its newest good checkpoint, with :class:`CheckpointManager`'s fallback past
corrupt ones — becomes a Keras config and ``get_weights()``-ordered weights, which the writers
turn into a file. The model takes what the trainer fed it: float32 NHWC images, uint8 data
already scaled to [0, 1] (``x / 255``); it outputs logits for the presets (their compile config
says ``from_logits=True``), or whatever the model's last layer gives.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from ringtrain.errors import CheckpointError, RingtrainError, exit_code_for
from ringtrain_trainer import model as model_mod
from ringtrain_trainer.checkpoint import CheckpointManager, TrainingState
from ringtrain_trainer.export.keras_file import write_keras
from ringtrain_trainer.export.onnx_file import write_onnx

FORMATS = ("keras", "onnx")


def _layer(cls: str, name: str, **config) -> dict:
    return {"module": "keras.layers", "class_name": cls, "config": {"name": name, **config},
            "registered_name": None}


def preset_keras(spec: model_mod.ModelSpec, params: np.ndarray,
                 optimizer: str) -> tuple[dict, list[np.ndarray]]:
    """The hard-coded ``cnn`` / ``cnn2`` as a Keras config and weights.

    REPLACE with ``spec.keras_config()`` / ``spec.keras_weights(params, state)`` once the model
    side of issue 10 is merged (:func:`keras_model` already prefers them). A ConvPool is Conv2D
    (valid, ReLU) then MaxPooling2D(2): the trainer adds bias and ReLU after pooling, which is
    the same function because max commutes with a per-channel bias and with ReLU.
    """
    h, w, c = spec.input_shape
    layers = [_layer("InputLayer", "input_layer", batch_shape=[None, h, w, c], dtype="float32")]
    weights: list[np.ndarray] = []
    views = spec.views(np.asarray(params, np.float32))
    convs = denses = 0
    for layer, p in zip(spec.layers, views):
        if layer.kind == "conv":
            suffix = f"_{convs}" if convs else ""
            layers += [_layer("Conv2D", f"conv2d{suffix}", filters=layer.cout,
                              kernel_size=[layer.k, layer.k], strides=[1, 1], padding="valid",
                              activation="relu", use_bias=True),
                       _layer("MaxPooling2D", f"max_pooling2d{suffix}", pool_size=[2, 2],
                              strides=[2, 2], padding="valid")]
            convs += 1
        else:
            if denses == 0:
                layers.append(_layer("Flatten", "flatten"))
            layers.append(_layer("Dense", f"dense{'_%d' % denses if denses else ''}",
                                 units=layer.n_out, use_bias=True,
                                 activation="relu" if layer.relu else "linear"))
            denses += 1
        weights += [p["kernel"].copy(), p["bias"].copy()]
    loss = {"module": "keras.losses", "class_name": "SparseCategoricalCrossentropy",
            "config": {"name": "sparse_categorical_crossentropy", "from_logits": True},
            "registered_name": None}
    config = {"module": "keras", "class_name": "Sequential", "registered_name": None,
              "config": {"name": spec.name, "layers": layers},
              "compile_config": {"optimizer": "adam" if optimizer == "adam" else "sgd",
                                 "loss": loss, "metrics": ["accuracy"]}}
    assert sum(math.prod(x.shape) for x in weights) == spec.num_params
    return config, weights


def keras_model(state: TrainingState) -> tuple[dict, list[np.ndarray]]:
    """The checkpoint's model as (Keras config, ``get_weights()``-ordered weights)."""
    spec = model_mod.build(state.model)
    if hasattr(spec, "keras_config") and hasattr(spec, "keras_weights"):
        return spec.keras_config(), spec.keras_weights(state.params,
                                                       getattr(state, "model_state", None))
    return preset_keras(spec, state.params, state.optimizer)


def export_state(state: TrainingState, output: str | Path, fmt: str = "keras") -> Path:
    """Write ``state``'s model to ``output`` as ``fmt`` (one of :data:`FORMATS`): what this
    command does with a checkpoint, and what the chief does at the end with ``--export``."""
    config, weights = keras_model(state)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    write = write_onnx if fmt == "onnx" else write_keras
    return write(output, config, weights)


def load_checkpoint(target: str | Path) -> TrainingState:
    """A manifest, or a directory's newest good checkpoint (corrupt ones reported, skipped)."""
    target = Path(target)
    if target.is_dir():
        state, skipped = CheckpointManager(target).load_latest()
        for e in skipped:
            print(f"ringtrain export: skipping corrupt checkpoint: {e}", file=sys.stderr)
        if state is None:
            raise CheckpointError(f"{target}: no checkpoint in this directory")
        return state
    return CheckpointManager(target.parent).load(target)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain export",
        description="Write a checkpoint's model as a Keras 3 .keras archive or an ONNX model.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_DIR",
                   help="a checkpoint manifest (ckpt-*.json) or a checkpoint directory "
                        "(its newest good checkpoint)")
    p.add_argument("-o", "--output", required=True, help="the file to write")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="default: from the output's suffix (.onnx → onnx), else keras")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    fmt = ns.format or ("onnx" if ns.output.endswith(".onnx") else "keras")
    try:
        state = load_checkpoint(ns.checkpoint)
        path = export_state(state, ns.output, fmt)
    except RingtrainError as e:
        print(f"ringtrain export: {type(e).__name__}: {e}", file=sys.stderr)
        return exit_code_for(e)
    print(f"ringtrain export: wrote {path} ({fmt}, model {state.model!r}, step {state.step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
