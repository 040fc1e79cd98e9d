"""Registry entry of Keras ``TimeDistributed``: any registered one-input layer applied to every
step of axis 1 (op: ``engine/ops/timedistributed.py``). The wrapped layer is parsed by its own
entry (its arguments refused as they would be unwrapped), its weights sit in the ``layer``
sub-group of ``model.weights.h5``, and its ONNX nodes run on the ``(batch * steps, ...)``
reshape of the input.

Keras calls the wrapped layer once per step, so a layer whose examples are not independent
would differ from one call on all steps: BatchNormalization (statistics per step) and the
dropout layers (ringtrain keys masks on the example) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial

import numpy as np

from ringtrain_trainer.engine.ops.timedistributed import TimeDistributed
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight, without_folded

#: wrapped classes refused: their result depends on which examples share a call
_NOT_PER_EXAMPLE = (
    "BatchNormalization",
    "Dropout",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "TimeDistributed",
    # draws keyed on the example, and a loss term the wrapper would not pass on
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
    "RandomFlip",
    "RandomRotation",
    "ActivityRegularization",
)


def _inner(table: Mapping[str, Entry], args: dict) -> tuple[Entry, str, dict]:
    layer = args["layer"]
    return table[layer["class_name"]], layer["class_name"], layer["config"]


def _parse(table: Mapping[str, Entry], a: Args) -> dict:
    v = a.take("layer")
    cls = v.get("class_name") if isinstance(v, dict) else v
    reg = table
    ok = [c for c in reg if reg[c].inputs == 1 and c not in _NOT_PER_EXAMPLE]
    if cls not in ok:
        a.refuse(
            "layer",
            cls,
            "a registered one-input layer without batch statistics or "
            "randomness (not " + ", ".join(_NOT_PER_EXAMPLE) + ")",
        )
    inner = Args(v, 0)
    for k in ("batch_input_shape", "input_shape", "batch_size"):
        inner.take(k)
    config = {"name": inner.name, **reg[cls].parse(inner), **inner.extra}
    a.done("layer")
    layer = {"module": "keras.layers", "class_name": cls, "config": config}
    return {"layer": {**layer, "registered_name": None}}


def _infer(table: Mapping[str, Entry], args: dict, shapes: list[Shape]) -> Shape:
    shape = shapes[0]
    if len(shape) < 2:
        raise ValueError(f"needs an input of (steps, ...), got {shape}")
    entry, _, config = _inner(table, args)
    return (shape[0], *entry.infer(config, [shape[1:]]))


def _weights(table: Mapping[str, Entry], args: dict, shapes: list[Shape]) -> list[Weight]:
    entry, _, config = _inner(table, args)
    out = []
    for w in entry.weights(config, [shapes[0][1:]]):
        group = f"layer/{w.group}" if w.group else "layer"
        out.append(Weight(w.name, w.shape, w.trainable, group, w.dtype))
    return out


def _weight_args(table: Mapping[str, Entry], args: dict, weight: str) -> tuple[dict, str]:
    entry, _, config = _inner(table, args)
    return entry.weight_args(config, weight)


def _inner_spec(table: Mapping[str, Entry], spec, inputs: tuple[int, ...], output: int):
    _, cls, config = _inner(table, spec.args)
    return replace(
        spec,
        cls=cls,
        name=config["name"],
        args=config,
        inputs=inputs,
        output=output,
        in_shapes=(spec.in_shapes[0][1:],),
        out_shape=spec.out_shape[1:],
    )


def _build(table: Mapping[str, Entry], spec, shapes, ctx):
    entry, _, _ = _inner(table, spec.args)
    inner = without_folded(_inner_spec(table, spec, spec.inputs, spec.output), ctx.fold)
    op = entry.build(inner, [tuple(shapes[0][1:])], ctx)
    if op is None:
        return None
    return TimeDistributed(op, shapes[0][0], shapes[0][1:], spec.out_shape[1:])


def _onnx(table: Mapping[str, Entry], g, spec, weights) -> None:
    """The wrapped layer's own nodes between two reshapes: (b, steps, ...) → (b * steps, ...)
    and back; its tensors get ids of their own (negative: no Keras tensor has one)."""
    entry, _, _ = _inner(table, spec.args)
    n, shape = spec.name, spec.in_shapes[0]
    flat = g.op(
        "Reshape",
        [g.x(0, nchw=False), g.const(f"{n}_flat", np.array([-1, *shape[1:]], np.int64))],
        f"{n}_flat",
    )
    t_in, t_out = -2 * spec.output - 1, -2 * spec.output - 2
    g.tensors[t_in] = (flat, False, len(shape))
    inner = _inner_spec(table, spec, (t_in,), t_out)
    g.spec = inner
    entry.onnx(g, inner, weights)
    g.spec = spec
    y = g.tensor(t_out, False)
    back = g.const(f"{n}_steps", np.array([-1, *spec.out_shape], np.int64))
    g.nchw = False
    g.out(g.op("Reshape", [y, back], n))


def _activation(table: Mapping[str, Entry], args: dict) -> str | None:
    entry, _, config = _inner(table, args)
    return entry.activation(config)


def entries(table: Mapping[str, Entry]) -> dict[str, Entry]:
    """The wrapper's entries, reading the wrapped layer's entry from ``table`` (the whole
    registry: ``keras.registry`` passes its own table, so this module need not import it)."""
    return {
        "TimeDistributed": Entry(
            partial(_parse, table),
            partial(_build, table),
            partial(_onnx, table),
            infer=partial(_infer, table),
            weights=partial(_weights, table),
            weight_args=partial(_weight_args, table),
            activation=partial(_activation, table),
            doc="`layer`: any one-input layer of this table but "
            + ", ".join(f"`{c}`" for c in _NOT_PER_EXAMPLE)
            + " (Keras calls it per step: their results depend on the call's batch)",
        ),
    }
