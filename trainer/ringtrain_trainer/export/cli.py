"""``ringtrain export CHECKPOINT_OR_DIR -o model.keras [--format keras|onnx]``.

Pipeline position: after training. A checkpoint (its ``ckpt-*.json`` manifest) or a checkpoint
directory — meaning its newest good checkpoint, with :class:`CheckpointManager`'s fallback past
corrupt ones — becomes a Keras config and ``get_weights()``-ordered weights, which the writers
turn into a file. The model takes what the trainer fed it (``data.Split``'s rule): a ``.npz``'s
numbers as stored (uint8 pixels 0..255 for a model that starts with ``Rescaling``), the built-in
data sets' pixels as ``x / 255``; it outputs logits for the presets (their compile config says
``from_logits=True``), or whatever the model's last layer gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ringtrain.errors import CheckpointError, RingtrainError, exit_code_for
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.export.onnx_file import write_onnx
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.keras.archive import write_keras
from ringtrain_trainer.keras.compile import wrap_loss_scale
from ringtrain_trainer.keras.load import any_length, describe

FORMATS = ("keras", "onnx")


def keras_model(
    state: TrainingState, precision: str | None = None, spec=None
) -> tuple[dict, list[np.ndarray]]:
    """The checkpoint's model as (Keras config, ``get_weights()``-ordered weights); its
    compile settings name the optimizer that trained it (``TrainingState.optimizer_config``),
    inside the source's LossScaleOptimizer if it had one, so Keras compiles the exported model
    with that optimizer, arguments and schedule. ``precision``: the run's, so a model trained
    in fp16 comes back under mixed_float16 (``archive.layer_dtype``). ``spec``: the model as
    the run compiled it (None dimensions fixed by its data), else rebuilt from the checkpoint."""
    spec = spec or keras_load.build(state.model, any_length)
    config = spec.keras_config(precision)
    if state.optimizer_config is not None and "compile_config" in config:
        own = spec.config.numerics
        optimizer = wrap_loss_scale(state.optimizer_config["keras"], own)
        config["compile_config"]["optimizer"] = optimizer
    return config, spec.keras_weights(state.params, state.model_state)


def export_state(
    state: TrainingState,
    output: str | Path,
    fmt: str = "keras",
    precision: str | None = None,
    spec=None,
) -> Path:
    """Write ``state``'s model to ``output`` as ``fmt`` (one of :data:`FORMATS`): what this
    command does with a checkpoint, and what the chief does at the end with ``--export``
    ``precision``: default the checkpoint's (``TrainingState.precision``). ONNX stays float32
    whatever the precision."""
    spec = spec or keras_load.build(state.model, any_length)
    CheckpointManager.require_model_state(state, spec)  # never fresh moving statistics
    config, weights = keras_model(state, precision or state.precision, spec)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "onnx":
        return write_onnx(output, config, weights, (spec.config or spec).input_shape)
    return write_keras(output, config, weights)


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
        description="Write a checkpoint's model as a Keras 3 .keras archive or an ONNX model.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_DIR",
        help="a checkpoint manifest (ckpt-*.json) or a checkpoint directory "
        "(its newest good checkpoint)",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="default: from the output's suffix (.onnx → onnx), else keras",
    )
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
    print(
        f"ringtrain export: wrote {path} ({fmt}, model {describe(state.model)}, step {state.step})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
