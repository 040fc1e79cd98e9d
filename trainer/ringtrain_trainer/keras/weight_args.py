"""Each weight's initializer, regularizer and constraint from its layer's Keras arguments.

Apart from ``keras_model`` because one rule — which ``*_initializer`` / ``*_regularizer`` /
``*_constraint`` argument belongs to which weight (``kernel``, ``recurrent_kernel``,
``depthwise_kernel`` …) — serves every layer, and an argument that names no trainable weight is
refused here rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.model import Slot
from ringtrain_trainer.engine.ops import initializers, regularizers
from ringtrain_trainer.keras.layer_spec import LayerSpec
from ringtrain_trainer.keras.registry import REGISTRY
from ringtrain_trainer.optim import constraints


def _weight_arg(weight: str) -> str:
    """The Keras argument prefix that initializes/regularizes a weight (``query_kernel`` and
    ``kernel`` ← ``kernel_*``, ``recurrent_kernel`` ← ``recurrent_*``)."""
    for kind in ("recurrent", "depthwise", "pointwise"):
        if weight.endswith(f"{kind}_kernel"):
            return kind
    for kind in ("kernel", "bias"):
        if weight == kind or weight.endswith(f"_{kind}"):
            return kind
    return weight


def with_weight_args(slots: list[Slot], layers: Sequence[LayerSpec], owner) -> list[Slot]:
    """The slots with each parameter's non-default initializer, regularizer and constraint
    (the layer's ``*_initializer``/``*_regularizer``/``*_constraint`` arguments, kept by
    ``Args``); one that names no trainable weight of its layer is refused, not ignored."""
    extra: dict[tuple[int, str], dict] = {}
    readers = {"init": initializers.parse, "reg": regularizers.parse}
    kinds = (("init", "initializer"), ("reg", "regularizer"), ("constraint", "constraint"))
    for s, li in zip(layers, owner, strict=True):
        if s.shares:  # a later call of a shared layer: the layer's own arguments say it
            continue
        used: set[str] = set()
        entry = REGISTRY[s.cls]
        for w in entry.weights(s.args, list(s.in_shapes)):
            args, own = entry.weight_args(s.args, w.name)
            for field, suffix in kinds:
                arg = f"{_weight_arg(own)}_{suffix}"
                if arg in args and s.frozen:  # no gradient, no penalty: as Keras
                    used.add(arg)
                elif arg in args and w.trainable and li is not None:
                    used.add(arg)
                    got: object  # an Initializer, a Regularizer or a Constraint
                    if field == "constraint":  # projected over the Keras weight's axes
                        c = constraints.parse(args[arg], arg)
                        got = c if c is None else replace(c, shape=tuple(w.shape))
                    else:
                        got = readers[field](args[arg], arg)
                        if getattr(got, "name", None) == "Identity" and len(w.shape) != 2:
                            raise InvalidSpec(
                                f"model: layer {s.name!r} ({s.cls}): {arg}=Identity is not "
                                f"supported for its weight {w.name} of shape {tuple(w.shape)} "
                                "(supported: a 2-D weight)"
                            )
                    extra.setdefault((li, w.name), {})[field] = got
        for k in s.args:
            optional = k.split("_")[0] in ("bias", "gamma", "beta")  # absent when switched off
            weighty = k.endswith(("_initializer", "_regularizer", "_constraint"))
            weighty = weighty and k != "activity_regularizer"  # the op's (keras_model)
            if weighty and k not in used and not optional:
                raise InvalidSpec(
                    f"model: layer {s.name!r} ({s.cls}): {k}={s.args[k]!r} is not supported "
                    "(supported: Keras' default; no trainable weight of this layer takes it)"
                )
    return [
        Slot(replace(x.spec, **extra[(x.spec.layer, x.spec.name)]), x.start, x.stop)
        if (x.spec.layer, x.spec.name) in extra
        else x
        for x in slots
    ]
