"""Registry entries of the recurrent layers: LSTM, GRU (``reset_after`` either way),
SimpleRNN and the ``Bidirectional`` wrapper around any of them. Their ops are
``engine/ops/recurrent.py`` and ``engine/ops/bidirectional.py``; the weights sit in the
``cell`` sub-group of ``model.weights.h5`` (a wrapper's in ``forward_layer/cell`` and
``backward_layer/cell``).

Initializers are read only to refuse one ringtrain would not honour (``layers_sequence``):
training starts from the ``.keras`` file's weights.
"""

from __future__ import annotations

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops import recurrent
from ringtrain_trainer.engine.ops.bidirectional import Bidirectional
from ringtrain_trainer.keras.entry import Args, Entry, Shape, Weight
from ringtrain_trainer.keras.layers_sequence import no

#: what the RNN ops differentiate from their outputs (``engine.ops.recurrent.ACTIVATIONS``)
RNN_ACTIVATIONS = ("tanh", "sigmoid", "relu", "linear")


# -- LSTM and GRU --------------------------------------------------------------------------------
def _rnn_parse(a: Args) -> dict:
    a.trainable()
    args = {
        "units": a.positive("units"),
        "activation": a.activation() if "activation" in a.cfg else "tanh",
        "recurrent_activation": a.activation("recurrent_activation")
        if "recurrent_activation" in a.cfg
        else "sigmoid",
        "use_bias": bool(a.take("use_bias", True)),
        "return_sequences": bool(a.take("return_sequences", False)),
    }
    for arg in ("activation", "recurrent_activation"):
        if args[arg] not in RNN_ACTIVATIONS:
            a.refuse(arg, args[arg], ", ".join(RNN_ACTIVATIONS))
    args["go_backwards"] = bool(a.take("go_backwards", False))
    for arg in ("return_state", "stateful", "time_major"):
        a.must_be(arg, False)
    v = a.take("dropout", 0.0)
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < 1:
        a.refuse("dropout", v, "a rate in [0, 1)")
    if v:  # one mask per sequence on the inputs (engine.ops.dropout.SharedDropout), as Keras
        args["dropout"] = float(v)
    v = a.take("recurrent_dropout", 0.0)
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < 1:
        a.refuse("recurrent_dropout", v, "a rate in [0, 1)")
    if v:  # a state mask per gate and sequence in the op (engine.ops.recurrent_loop)
        args["recurrent_dropout"] = float(v)
    a.take("unroll")  # the same arithmetic either way
    a.take("implementation")  # tf.keras 2's kernel choice: the same arithmetic
    args["zero_output_for_mask"] = bool(a.take("zero_output_for_mask", False))
    a.take("seed")
    if a.cls == "LSTM":
        a.take("unit_forget_bias")  # an initializer: the weights come from the file or init
    elif a.cls == "GRU":
        args["reset_after"] = bool(a.take("reset_after", True))
        if not args["reset_after"] and args.get("recurrent_dropout"):
            a.refuse("recurrent_dropout", args["recurrent_dropout"], "0 with reset_after=False")
    else:  # SimpleRNN has no gates; its op ignores the argument
        del args["recurrent_activation"]
    a.initializer("kernel_initializer", "GlorotUniform")
    a.initializer("recurrent_initializer", "Orthogonal")
    a.initializer("bias_initializer", "Zeros")
    no(
        a,
        "kernel_regularizer",
        "recurrent_regularizer",
        "bias_regularizer",
        "kernel_constraint",
        "recurrent_constraint",
        "bias_constraint",
    )
    a.done("units, activation, recurrent_activation, use_bias, return_sequences, go_backwards")
    return args


#: Keras class → the gate blocks of its kernels (the ONNX op has the same name but SimpleRNN's)
GATES = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}
_ONNX_OP = {"LSTM": "LSTM", "GRU": "GRU", "SimpleRNN": "RNN"}


def _gates(cls: str) -> int:
    return GATES[cls]


def _rnn_infer(args: dict, shapes: list[Shape]) -> Shape:
    if len(shapes[0]) != 2:
        raise ValueError(f"needs an input of (timesteps, features), got {shapes[0]}")
    u = args["units"]
    return (shapes[0][0], u) if args["return_sequences"] else (u,)


def _two_biases(cls: str, args: dict) -> bool:
    """Keras' GRU with ``reset_after=True`` (its default) has an input and a recurrent bias."""
    return cls == "GRU" and args.get("reset_after", True)


def _rnn_weights_of(cls: str):
    def weights(args: dict, shapes: list[Shape]) -> list[Weight]:
        u, g = args["units"], _gates(cls) * args["units"]
        out = [
            Weight("kernel", (shapes[0][-1], g), group="cell"),
            Weight("recurrent_kernel", (u, g), group="cell"),
        ]
        if args["use_bias"]:
            out.append(Weight("bias", (2, g) if _two_biases(cls, args) else (g,), group="cell"))
        return out

    return weights


def in_op_dropout(cls: str, args: dict) -> bool:
    """Whether the op itself draws the input masks: with ``recurrent_dropout`` Keras runs an
    LSTM's or GRU's cell with a mask per gate (``implementation=1``), which no one node before
    the op draws; else a SharedDropout node before it does (``lowering._input_dropout``)."""
    return bool(args.get("recurrent_dropout")) and cls != "SimpleRNN"


def _rnn_op(
    cls: str,
    a: dict,
    shape: Shape,
    masked: bool = False,
    zero_output: bool = False,
    index: int = 0,
):
    op = "GRUResetBefore" if cls == "GRU" and not a.get("reset_after", True) else cls
    return getattr(recurrent, op)(
        shape,
        a["units"],
        a["activation"],
        a.get("recurrent_activation", "sigmoid"),
        a["use_bias"],
        a["return_sequences"],
        a["go_backwards"],
        masked,
        zero_output,
        a.get("dropout", 0.0),
        a.get("recurrent_dropout", 0.0),
        index,
    )


def _rnn_build(spec, shapes, ctx):
    a = spec.args
    zero = a.get("zero_output_for_mask", False)
    return _rnn_op(spec.cls, a, shapes[0], bool(ctx.mask), zero, ctx.index)


#: Slice's starts, ends, axes, steps that reverse the time axis of a time-major tensor
_FLIP = {"start": -1, "end": -(2**62), "axis": 0, "step": -1}
_ONNX_ACT = {"tanh": "Tanh", "sigmoid": "Sigmoid", "relu": "Relu"}


def _onnx_direction(cls: str, a: dict, weights, where: str):
    """One direction's ONNX ``W``, ``R``, ``B`` (each with the leading direction axis): gate
    blocks reordered from Keras' i, f, c, o to ONNX's i, o, f, c (GRU's z, r, h is the same in
    both), kernels transposed, input and recurrent biases side by side."""
    for arg in ("activation", "recurrent_activation"):
        if a.get(arg, "sigmoid") not in _ONNX_ACT:
            raise InvalidSpec(f"export: {where}: {arg}={a.get(arg)!r} has no ONNX")
    u, lstm, gates = a["units"], cls == "LSTM", GATES[cls]
    kernel, rec = weights[0], weights[1]
    two = _two_biases(cls, a)
    bias = weights[2] if a["use_bias"] else np.zeros((2, gates * u) if two else gates * u)
    order = [0, 3, 1, 2] if lstm else list(range(gates))

    def blocks(m):
        return np.concatenate([m[..., k * u : (k + 1) * u] for k in order], axis=-1)

    wx, wh = (blocks(m).T[None].astype(np.float32) for m in (kernel, rec))
    pair = [bias[0], bias[1]] if two else [blocks(bias), np.zeros(gates * u)]
    return wx, wh, np.concatenate(pair)[None].astype(np.float32)


def _onnx_rnn(g, n: str, cls: str, a: dict, wrb, direction: str) -> tuple[str, str]:
    """The ONNX LSTM/GRU node on the current layer's input made time-major: (Y, Y_h)."""
    x = g.op("Transpose", [g.x(0, nchw=False)], f"{n}_time_major", perm=[1, 0, 2])
    gates, act = GATES[cls], _ONNX_ACT[a["activation"]]
    acts = [_ONNX_ACT[a["recurrent_activation"]], *[act] * (gates - 2)] if gates > 1 else [act]
    dirs = 2 if direction == "bidirectional" else 1
    ins = [x, *(g.const(f"{n}_{k}", v) for k, v in zip("WRB", wrb, strict=True))]
    attrs = {"hidden_size": a["units"], "activations": acts * dirs, "direction": direction}
    if cls == "GRU":
        attrs["linear_before_reset"] = int(a.get("reset_after", True))
    outs = [g.name(f"{n}_Y"), g.name(f"{n}_Y_h")]
    g.nodes.append(g.h.make_node(_ONNX_OP[cls], ins, outs, name=outs[0], **attrs))
    return outs[0], outs[1]


def _axes(g, n: str, *axes: int) -> str:
    return g.const(f"{n}_axes", np.array(axes, np.int64))


def _rnn_onnx(g, spec, weights) -> None:
    """ONNX ``LSTM`` / ``GRU``, time-major, one direction (``reverse`` for go_backwards)."""
    a, n = spec.args, spec.name
    wrb = _onnx_direction(spec.cls, a, weights, f"layer {n!r} ({spec.cls})")
    y, y_h = _onnx_rnn(g, n, spec.cls, a, wrb, "reverse" if a["go_backwards"] else "forward")
    if a["return_sequences"]:
        y = g.op("Squeeze", [y, _axes(g, n, 1)], f"{n}_seq")
        if a["go_backwards"]:  # ONNX keeps outputs at their timesteps; Keras, in step order
            flip = [g.const(f"{n}_{k}", [v]) for k, v in _FLIP.items()]
            y = g.op("Slice", [y, *flip], f"{n}_steps")
        g.out(g.op("Transpose", [y], f"{n}_batch_major", perm=[1, 0, 2]))
    else:
        g.out(g.op("Squeeze", [y_h, _axes(g, n, 0)], n))


# -- Bidirectional -----------------------------------------------------------------------------
MERGE_MODES = ("concat", "sum", "ave", "mul")
_HALVES = (("forward", "layer"), ("backward", "backward_layer"))


def _inner(a: Args, arg: str, v) -> dict:
    cls = v.get("class_name") if isinstance(v, dict) else v
    if cls not in GATES:
        a.refuse(arg, cls, ", ".join(GATES))
    inner = Args(v, 0)
    args = {**_rnn_parse(inner), **inner.extra}
    for rate in ("dropout", "recurrent_dropout"):  # Keras draws masks per half
        if args.get(rate):
            a.refuse(f"{arg}.{rate}", args[rate], "0 inside Bidirectional")
    return _layer(cls, {"name": inner.name, **args})


def _layer(cls: str, config: dict) -> dict:
    """A wrapped layer as Keras serializes it (it deserializes one only with its module)."""
    return {"module": "keras.layers", "class_name": cls, "config": config, "registered_name": None}


def _bi_parse(a: Args) -> dict:
    a.trainable()
    merge = a.take("merge_mode", "concat")
    if merge not in MERGE_MODES:
        a.refuse("merge_mode", merge, ", ".join(MERGE_MODES))
    fwd = _inner(a, "layer", a.take("layer"))
    bwd = a.take("backward_layer")
    if bwd is None:  # Keras' default: the same layer reading the other way
        cfg = dict(fwd["config"], go_backwards=not fwd["config"]["go_backwards"])
        cfg["name"] = "backward_" + cfg["name"].removeprefix("forward_")
        back = _layer(fwd["class_name"], cfg)
    else:
        back = _inner(a, "backward_layer", bwd)
    f, b = fwd["config"], back["config"]
    if f["go_backwards"] == b["go_backwards"] or f["return_sequences"] != b["return_sequences"]:
        a.refuse("backward_layer", b["name"], "the other go_backwards, the same return_sequences")
    a.done("layer, backward_layer, merge_mode")
    return {"layer": fwd, "backward_layer": back, "merge_mode": merge}


def _bi_infer(args: dict, shapes: list[Shape]) -> Shape:
    fo, bo = (_rnn_infer(args[key]["config"], shapes) for _, key in _HALVES)
    if args["merge_mode"] == "concat":
        return (*fo[:-1], fo[-1] + bo[-1])
    if fo != bo:
        raise ValueError(f"merge_mode={args['merge_mode']!r} needs halves of one shape")
    return fo


def _bi_weights(args: dict, shapes: list[Shape]) -> list[Weight]:
    out = []
    for half, key in _HALVES:
        inner = args[key]
        for w in _rnn_weights_of(inner["class_name"])(inner["config"], shapes):
            group = ("forward_layer" if half == "forward" else key) + "/cell"
            out.append(Weight(f"{half}_{w.name}", w.shape, group=group))
    return out


def _bi_weight_args(args: dict, weight: str) -> tuple[dict, str]:
    """A half's weight (``forward_kernel``) takes its wrapped layer's arguments."""
    half, _, name = weight.partition("_")
    return args[dict(_HALVES)[half]]["config"], name


def _bi_build(spec, shapes, ctx):
    a, m = spec.args, bool(ctx.mask)
    # Keras' Bidirectional sets zero_output_for_mask = return_sequences on both halves
    forward, backward = (
        _rnn_op(c["class_name"], c["config"], shapes[0], m, c["config"]["return_sequences"])
        for c in (a[k] for _, k in _HALVES)
    )
    return Bidirectional(forward, backward, a["merge_mode"])


def _bi_onnx(g, spec, weights) -> None:
    """One bidirectional ONNX LSTM/GRU: ONNX's reverse direction keeps its outputs at their
    timesteps, which is Keras' flipped-back backward sequence; the merge is a reshape (concat)
    or a reduction over the direction axis."""
    a, n = spec.args, spec.name
    f, b = a["layer"], a["backward_layer"]
    same = ("units", "activation", "return_sequences")
    if (
        f["class_name"] != b["class_name"]
        or f["config"]["go_backwards"]
        or any(f["config"][k] != b["config"][k] for k in same)
    ):
        raise InvalidSpec(
            f"export: layer {n!r} (Bidirectional): ONNX needs two halves alike but for direction"
        )
    cls, cfg, k = f["class_name"], f["config"], len(weights) // 2
    wf = _onnx_direction(cls, cfg, weights[:k], f"layer {n!r}")
    wb = _onnx_direction(cls, b["config"], weights[k:], f"layer {n!r}")
    wrb = [np.concatenate(pair) for pair in zip(wf, wb, strict=True)]
    y, y_h = _onnx_rnn(g, n, cls, cfg, wrb, "bidirectional")
    seq, mode = cfg["return_sequences"], a["merge_mode"]
    src, axis = (y, 1) if seq else (y_h, 0)  # Y: (T, 2, b, u); Y_h: (2, b, u)
    if mode == "concat":
        perm = [2, 0, 1, 3] if seq else [1, 0, 2]
        t = g.op("Transpose", [src], f"{n}_batch_major", perm=perm)
        shape = [0, 0, -1] if seq else [0, -1]
        g.out(g.op("Reshape", [t, g.const(f"{n}_shape", np.array(shape, np.int64))], n))
        return
    if mode == "sum":
        r = g.op("ReduceSum", [src, _axes(g, n, axis)], f"{n}_merge", keepdims=0)
    else:
        op = "ReduceMean" if mode == "ave" else "ReduceProd"
        r = g.op(op, [src], f"{n}_merge", axes=[axis], keepdims=0)
    g.out(g.op("Transpose", [r], f"{n}_batch_major", perm=[1, 0, 2]) if seq else r)


def _cell_activation(args: dict) -> None:
    """None: ``activation`` is the cell's, inside the recurrence; the layer's output is no
    activation's output that a loss could fold (Keras' backend finds no logits on it either)."""
    return None


ENTRIES = {
    **{
        cls: Entry(
            _rnn_parse,
            _rnn_build,
            _rnn_onnx,
            infer=_rnn_infer,
            weights=_rnn_weights_of(cls),
            activation=_cell_activation,
            doc="`units`, `activation`, `recurrent_activation` (tanh, sigmoid, relu, linear), "
            "`use_bias`, `return_sequences`, `go_backwards`, `zero_output_for_mask`, `dropout` "
            "(one input mask per sequence, as Keras), `recurrent_dropout` (a state mask per gate "
            "and sequence, with `dropout` then an input mask per gate, as Keras); an "
            "incoming Keras mask skips masked timesteps; backpropagation through time in the op"
            + ("; `reset_after` (False: one bias, `recurrent_dropout` 0)" if cls == "GRU" else ""),
        )
        for cls in ("LSTM", "GRU")
    },
    "SimpleRNN": Entry(
        _rnn_parse,
        _rnn_build,
        _rnn_onnx,
        infer=_rnn_infer,
        weights=_rnn_weights_of("SimpleRNN"),
        activation=_cell_activation,
        doc="`units`, `activation` (tanh, sigmoid, relu, linear), `use_bias`, "
        "`return_sequences`, `go_backwards`, `zero_output_for_mask`, `dropout`, "
        "`recurrent_dropout`; an incoming mask",
    ),
    "Bidirectional": Entry(
        _bi_parse,
        _bi_build,
        _bi_onnx,
        infer=_bi_infer,
        weights=_bi_weights,
        weight_args=_bi_weight_args,
        doc="an LSTM, GRU or SimpleRNN (and its `backward_layer`; `dropout` and "
        "`recurrent_dropout` 0: Keras draws masks per half), `merge_mode` (concat, sum, ave, "
        "mul); an incoming mask (both halves)",
    ),
}
