"""The model's outputs as the loss sees them: the activation each output's loss folds away
(softmax/sigmoid into the cross-entropy, as the IPU's loss reads logits) and each output's width.

Apart from ``keras_model`` because a model with several outputs (``engine.multiloss``) asks
both questions per output, by the output's Keras name in its errors.
"""

from __future__ import annotations

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.loss_spec import LossSpec
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.keras.config import ModelConfig


def heads(config: ModelConfig) -> dict[int, str | None]:
    """Each output tensor → the activation its loss folds away (None: none)."""
    loss = config.loss
    if not isinstance(loss, MultiLossSpec):
        return {config.output: loss.folded}
    return {
        t: h.loss.folded if h.loss else None
        for t, h in zip(config.outputs, loss.heads, strict=True)
    }


def output_shape(config: ModelConfig, ops: list, where: dict[int, int], t: int) -> tuple:
    """An output's shape per example, checked against its loss: ``(units,)``, or for a single
    output ``(*positions, units)`` (a loss per timestep or pixel: sequence tagging,
    segmentation, autoencoders); ≥ 2 classes for a classifier."""
    shape = tuple(ops[where[t] - 1].out_shape) if where[t] > 0 else ()
    loss: LossSpec | MultiLossSpec | None = config.loss
    name = None
    if isinstance(loss, MultiLossSpec):
        k = config.outputs.index(t)
        name, loss = config.output_names[k], loss.heads[k].loss
    kind = loss.kind if loss is not None else "regression"
    what = f"the output {name!r}'s shape" if name else "the output shape"
    if len(shape) > 1 and name:
        raise InvalidSpec(
            f"model: {what} is {shape}; a loss per position ({getattr(loss, 'name', 'a loss')} "
            "on every timestep or pixel) is supported on a model with one output, not yet on "
            "one of several: the heads read one flat vector per example (end this output with "
            "Flatten/GlobalPooling and Dense(units))"
        )
    if not shape or (shape[-1] < 2 and kind in ("sparse", "categorical")):
        raise InvalidSpec(
            f"model: {what} is {shape}; "
            + (
                "a classifier needs one score per class (end with Dense(num_classes))"
                if kind in ("sparse", "categorical")
                else f"{getattr(loss, 'name', 'an output')} needs an output with units "
                "(end with Dense(units))"
            )
        )
    return shape
