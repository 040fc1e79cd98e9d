"""Keras class name → :class:`~.entry.Entry`: the one table of the layers ringtrain runs.

Everything about a layer is its entry, so the trainer (``keras.load``), the spec check
(``config``), the memory budget, the ``.keras`` writer and the ONNX writer can never disagree.

How to add a layer (one entry + its op):

1. The op, if the engine has none yet: a class in ``engine/ops/<family>.py`` in the
   ``engine.op.Op`` protocol (``buffers``, ``forward``, ``backward_input``, and for weights
   ``params`` + ``backward_weights``), and a case in tests/trainer/test_engine_ops.py (the
   shared finite-difference check fails until it has one).
2. The entry, in a ``keras/layers_<family>.py`` module's ``ENTRIES`` (listed below)::

       def _parse(a: Args) -> dict:          # consume every argument, refuse the rest
           args = {"units": a.positive("units"), "activation": a.activation()}
           a.done("units, activation")        # anything left is refused by name
           return args                        # also what the exported config carries

       "MyDense": Entry(
           _parse,
           build=lambda spec, shapes, ctx: MyDenseOp(shapes[0], **spec.args),
           onnx=_onnx,                        # g.x(0) → g.op(...) → g.out(name)
           infer=lambda args, shapes: (*shapes[0][:-1], args["units"]),
           weights=lambda args, shapes: [Weight("kernel", (shapes[0][-1], args["units"]))],
       )

   ``weights`` is ``get_weights()``'s order and names the op's ``params`` (trainable) or
   ``state_specs`` (``Weight(..., trainable=False)``).
3. A model using it in tests/trainer/test_keras_reference.py (against real Keras) and in
   test_export_keras_onnx.py; the layer table (docs/layers.md) is generated from this registry.
"""

from __future__ import annotations

from ringtrain_trainer.engine.ops import initializers
from ringtrain_trainer.keras import (
    layers_activation,
    layers_activity,
    layers_attention,
    layers_augment,
    layers_augment_pixel,
    layers_conv,
    layers_convtranspose,
    layers_core,
    layers_dot,
    layers_encoding,
    layers_identity,
    layers_merge,
    layers_noise,
    layers_norm,
    layers_preprocessing,
    layers_recurrent,
    layers_resize,
    layers_scale,
    layers_sequence,
    layers_shape,
    layers_window,
    layers_wrap,
)
from ringtrain_trainer.keras.entry import Entry
from ringtrain_trainer.optim import constraints

#: every layer ringtrain trains and exports, by Keras class name (order: the README's)
REGISTRY: dict[str, Entry] = {}
#: the wrapper reads the entry of the layer it wraps from the whole table, filled just below
_WRAP = layers_wrap.entries(REGISTRY)
REGISTRY.update(
    {
        **layers_conv.ENTRIES,
        **layers_window.ENTRIES,
        **layers_convtranspose.ENTRIES,
        **layers_shape.ENTRIES,
        **layers_core.ENTRIES,
        **layers_preprocessing.ENTRIES,
        **layers_resize.ENTRIES,
        **layers_scale.ENTRIES,
        **layers_activation.ENTRIES,
        **layers_merge.ENTRIES,
        **layers_noise.ENTRIES,
        **layers_activity.ENTRIES,
        **layers_augment.ENTRIES,
        **layers_augment_pixel.ENTRIES,
        **layers_sequence.ENTRIES,
        **layers_recurrent.ENTRIES,
        **layers_attention.ENTRIES,
        **_WRAP,
        **layers_identity.ENTRIES,
        **layers_norm.ENTRIES,
        **layers_dot.ENTRIES,
        **layers_encoding.ENTRIES,
    }
)
#: what refusals list as supported (InputLayer is read by ``config`` itself)
SUPPORTED = ("InputLayer", *REGISTRY)


def entry(cls: str) -> Entry:
    """The entry of Keras class ``cls`` (the caller has checked it is in :data:`REGISTRY`)."""
    return REGISTRY[cls]


#: the generated block of supported layers (in :data:`PAGE`) lies between these lines
BEGIN = "<!-- layers: generated from keras/registry.py by "
BEGIN += "`python -m ringtrain_trainer.keras.registry docs/layers.md`; do not edit -->"
END = "<!-- layers: end -->"
#: the documentation page that holds the table (relative to the repository's root)
PAGE = "docs/layers.md"


def markdown() -> str:
    """The table of supported layers (docs/layers.md), one row per entry."""
    inputs = "each of the model's inputs, of a fixed shape (several: data named per input)"
    rows = ["| layer | supported |", "|---|---|", f"| `InputLayer` | {inputs} |"]
    rows += [
        "| nested `Functional` / `Sequential` | a model used as a layer (`x = base(inp)`, "
        "ConvNeXt's blocks): flattened into one graph at parse time, its layers named "
        "`base/conv1` (also in `pipeline.stages`), exported nested again; Keras 3 configs; "
        "a nested model called several times (a Siamese tower) is one shared layer per call, "
        "exported as one nested model with a node per call; refused: a layer shared inside "
        "a nested model that is itself called several times |",
        "| shared layers | one layer called on several tensors (Siamese towers, a Dense applied "
        "twice): one op per call on one set of weights, every call's weight gradient summed "
        "before it streams; exported as one layer with its calls; Keras 3 configs; refused: a "
        "shared BatchNormalization, a frozen shared layer, calls in two pipeline stages |",
        "| `trainable=False` | on a layer, a nested model or a whole base: its weights are held "
        "as state — no gradient, not reduced over the ring, not optimized, kept by checkpoints "
        "and exports; a frozen BatchNormalization runs in inference mode (as Keras 3); the "
        "start-up log and the memory report count them; needs starting weights (a `.keras` "
        "file): fresh frozen weights would stay random; not with `--precision fp16` |",
    ]
    rows += [f"| `{cls}` | {e.doc} |" for cls, e in REGISTRY.items()]
    rows += [
        "",
        "Every layer with weights (also the LSTM/GRU inside `Bidirectional`) takes, per weight, "
        "`kernel_`, `bias_`, `recurrent_`, `depthwise_`, `pointwise_`, `embeddings_`, "
        "`gamma_`, `beta_` + `initializer` (any of "
        + ", ".join(initializers.SUPPORTED)
        + "; fresh weights draw from it, the export writes it back) and + `regularizer` "
        '(`L1`, `L2`, `L1L2`, `"l1"`, `"l2"`: the penalty is in the reported training and '
        "test loss, its gradient added once to the reduced gradient before clipping, the "
        "export writes it back). Any layer takes `activity_regularizer` (`L1`, `L2`, `L1L2`: "
        "`(l1·Σ|x| + l2·Σx²) / batch` of its output joins the training loss, as Keras 3 adds "
        "it; refused inside a wrapper and on an output whose activation the loss computes). "
        "Weight constraints (`kernel_constraint=` & co.: "
        + ", ".join(constraints.SUPPORTED)
        + ") project the weight after each optimizer step, as Keras does; the export writes "
        "them back. Refused, by name: non-default `moving_*_initializer`.",
    ]
    return "\n".join(rows)


def with_table(text: str) -> str:
    """``text`` (docs/layers.md) with the block between :data:`BEGIN` and :data:`END` rewritten."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    page = Path(sys.argv[1] if len(sys.argv) > 1 else PAGE)
    page.write_text(with_table(page.read_text()))
