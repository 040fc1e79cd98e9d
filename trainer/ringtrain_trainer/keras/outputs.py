"""The model's outputs as the loss sees them: the activation each output's loss folds away
(softmax/sigmoid into the cross-entropy, as the IPU's loss reads logits) and each output's width.

Apart from ``keras_model`` because a model with several outputs (``engine.multiloss``) asks
both questions per output, by the output's Keras name in its errors.
"""

from __future__ import annotations

from ringtrain.errors import InvalidSpec
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


def output_width(config: ModelConfig, ops: list, where: dict[int, int], t: int) -> int:
    """An output's units; refused unless flat (and ≥ 2 classes for a classifier)."""
    shape = tuple(ops[where[t] - 1].out_shape) if where[t] > 0 else ()
    loss = config.loss
    name = None
    if isinstance(loss, MultiLossSpec):
        k = config.outputs.index(t)
        name, loss = config.output_names[k], loss.heads[k].loss
    kind = loss.kind if loss is not None else "regression"
    what = f"the output {name!r}'s shape" if name else "the output shape"
    if len(shape) > 1:
        raise InvalidSpec(
            f"model: {what} is {shape}; a loss per position ({getattr(loss, 'name', 'a loss')} "
            "on every timestep or pixel: sequence tagging, segmentation, autoencoders) is not "
            "supported yet: the loss reads one flat vector per example (end with "
            "Flatten/GlobalPooling and Dense(units))"
        )
    if len(shape) != 1 or (shape[0] < 2 and kind in ("sparse", "categorical")):
        raise InvalidSpec(
            f"model: {what} is {shape}; "
            + (
                "a classifier needs one score per class (end with Dense(num_classes))"
                if kind in ("sparse", "categorical")
                else f"{getattr(loss, 'name', 'an output')} needs a flat output "
                "(end with Dense(units))"
            )
        )
    return shape[0]
