"""Keras 3's mask propagation, decided once from the config: which tensor carries which mask.

Keras attaches a boolean ``(batch, timesteps)`` mask to the output of ``Embedding(mask_zero=
True)`` and ``Masking``; every later layer either *consumes* it (an RNN skips masked steps,
``GlobalAveragePooling1D`` averages the rest, ``MultiHeadAttention`` builds its attention mask
from its inputs' masks), *passes* it on unchanged (``supports_masking`` layers that ignore it:
Dense, Dropout, activations, LayerNormalization), *merges* several (Add, Concatenate: Keras
3's logical OR; an unmasked input makes the result unmasked), or *drops* it (a layer without
``supports_masking``: Conv1D, Flatten, GlobalMaxPooling1D — Keras warns, the mask is gone).
Ringtrain does exactly that; a layer that would receive a mask and uses it in a way ringtrain
does not run (Softmax, BatchNormalization, a Concatenate along the time axis) is refused by
name, never run unmasked.

A mask is a hashable *key* that says how to compute it from the data, so the trainer builds
each distinct mask once per batch (``keras_model``): ``("zero", t)`` ids ``t != 0``;
``("value", t, v)`` ``any(t != v, -1)``; ``("or", (k1, k2, ...))`` (sorted, so every
worker builds the same graph). Pure Python: the operator's spec check runs it too.

A Keras 3 Functional config may spell a mask out: the ops Keras ran to merge masks
(``NotEqual(ids, 0)``, ``Any(NotEqual(x, v), axis=-1)``, ``LogicalOr``, Concatenate's
``ExpandDims``/``ZerosLike``/``concatenate``/``Any``) appear as operation nodes and a layer's
``mask`` call argument names their result. :func:`key_of` reads such an expression back into a
key; the parser accepts it only when it is the mask these rules give that layer anyway.
"""

from __future__ import annotations

from typing import Any

from ringtrain.errors import InvalidSpec

Key = tuple[Any, ...]

#: Keras 3 layers with ``supports_masking`` whose ``call`` ignores the mask: it passes through
PASS = frozenset(
    {
        "Dense",
        "Dropout",
        "SpatialDropout1D",
        "Activation",
        "ReLU",
        "LeakyReLU",
        "ELU",
        "PReLU",
        "Rescaling",
        "Normalization",
        "LayerNormalization",
        "Identity",
        "UnitNormalization",
        "GroupNormalization",
    }
)
#: Keras 3 layers without ``supports_masking``: Keras drops the mask there (with its warning)
DROP = frozenset(
    {
        "Conv1D",
        "DepthwiseConv1D",
        "SeparableConv1D",
        "MaxPooling1D",
        "AveragePooling1D",
        "GlobalMaxPooling1D",
        "ZeroPadding1D",
        "Cropping1D",
        "UpSampling1D",
        "Flatten",
        "Reshape",
        "Permute",
        "RepeatVector",
    }
)
MERGE = frozenset({"Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate"})
RNN = frozenset({"LSTM", "GRU", "SimpleRNN", "Bidirectional"})
#: every layer that reads a mask (the op gets it as an extra input)
CONSUME = RNN | {"GlobalAveragePooling1D", "MultiHeadAttention"}
TAKES = sorted(PASS | MERGE | CONSUME | DROP)


#: the Keras operations a Functional config uses to spell a mask out (:func:`key_of`); any
#: operation on booleans is one (``is_mask_op``)
MASK_OPS = frozenset({"NotEqual", "Any", "LogicalOr"})


def is_mask_op(cls: str, args: list, cfg: dict) -> bool:
    """Whether an operation node computes a mask: one of :data:`MASK_OPS`, or one on boolean
    tensors only or making one (Concatenate's ``ExpandDims``, ``ZerosLike(dtype="bool")``,
    ``ops.concatenate`` of masks)."""
    flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
    dtypes = {a.get("config", {}).get("dtype") for a in flat if isinstance(a, dict)}
    return cls in MASK_OPS or dtypes == {"bool"} or cfg.get("dtype") == "bool"


def _or(keys: list[Key]) -> Key:
    flat: set[Key] = set()
    for k in keys:
        flat.update(k[1] if k[0] == "or" else (k,))
    uniq = sorted(flat, key=repr)
    return uniq[0] if len(uniq) == 1 else ("or", tuple(uniq))


def key_of(expr: Any, ops: dict, tensors: dict, rank, where: str) -> Key | None:
    """The key of a spelled-out mask (None: all true, Concatenate's unmasked input): ``expr``
    a ``keras_history`` triple, ``ops`` the mask operations by history (class, args, config),
    ``tensors`` history → tensor, ``rank(t)`` a tensor's rank without the batch axis.

    Evaluated symbolically: ``("step", key)`` a ``(T,)`` mask, ``("feat", key)`` one broadcast
    over features (``ExpandDims(m, -1)``), ``("ne", (t, v))`` ``NotEqual(x, v)`` per value
    (``Any(·, -1)`` makes it Masking's key), ``("false"|"true", None)`` the constants."""

    def refuse() -> InvalidSpec:
        return InvalidSpec(
            f"model: {where}: its mask argument {list(expr)} is not a mask ringtrain derives "
            "(supported: the mask Keras propagates from Embedding(mask_zero=True) or Masking)"
        )

    def ev(h) -> tuple[str, Any]:
        if h not in ops:
            raise refuse()
        cls, args, cfg = ops[h]
        ts = [a for a in args if isinstance(a, tuple)]
        if cls == "NotEqual" and len(args) == 2 and len(ts) == 1 and ts[0] in tensors:
            v = next(a for a in args if not isinstance(a, tuple))
            t = tensors[ts[0]]
            if rank(t) == 1 and v == 0:
                return ("step", ("zero", t))
            if rank(t) >= 2 and isinstance(v, (int, float)):
                return ("ne", (t, float(v)))
        if cls in ("ZerosLike", "OnesLike") and len(ts) == 1:
            return ("false" if cls == "ZerosLike" else "true", None)
        if cls == "ExpandDims" and cfg.get("axis") == -1 and len(ts) == 1:
            kind, k = ev(ts[0])
            if kind == "step":
                return ("feat", k)
            if kind in ("true", "false"):
                return (kind, None)
        if cls == "Any" and (cfg.get("axis"), bool(cfg.get("keepdims"))) == (-1, False):
            got: tuple[str, Any] = ev(ts[0]) if len(ts) == 1 else ("", None)
            kind, k = got
            if kind == "ne":
                return ("step", ("value", *k))
            if kind in ("feat", "true", "false"):
                return ("step" if kind == "feat" else kind, k)
        parts = args[0] if cls == "Concatenate" and len(args) == 1 else ts
        if cls == "Concatenate" and cfg.get("axis") not in (-1, None):
            raise refuse()
        if cls in ("LogicalOr", "Concatenate") and parts:
            vals = [ev(p) for p in parts]
            if any(kind == "true" for kind, _ in vals):
                return ("true", None)
            keys = [k for kind, k in vals if kind in ("step", "feat")]
            if len(keys) + sum(kind == "false" for kind, _ in vals) == len(vals):
                if not keys:
                    return ("false", None)
                feat = any(kind == "feat" for kind, _ in vals) or cls == "Concatenate"
                return ("feat" if feat else "step", _or(keys))
        raise refuse()

    kind, key = ev(expr)
    if kind == "true":
        return None
    if kind != "step":
        raise refuse()
    return key


def attention_sources(s, masks: list[Key | None]) -> list[tuple[str, Key]]:
    """MultiHeadAttention's (role, mask) pairs, Keras' ``_compute_attention_mask``: the query's
    mask, the value's, and a separate key's (a key that *is* the value adds nothing)."""
    roles = ["query", "value", "key"][: len(masks)] if len(masks) > 1 else ["query"]
    out = [(r, m) for r, m in zip(roles, masks, strict=True) if m is not None]
    if len(masks) == 1 and masks[0] is not None:  # self-attention on one tensor
        out.append(("value", masks[0]))
    if len(masks) == 3 and s.inputs[2] == s.inputs[1]:
        out = [(r, m) for r, m in out if r != "key"]
    return out


def propagate(layers, outputs: tuple[int, ...]) -> dict[int, Key]:
    """Tensor → the key of the mask it carries (absent: none), in Keras' rules (module doc);
    refuses, naming the layer, what ringtrain would otherwise run without its mask, and a mask
    still on any of the model's ``outputs``."""
    masks: dict[int, Key] = {}
    for s in layers:
        ins = [masks.get(t) for t in s.inputs]
        got = [m for m in ins if m is not None]
        out: Key | None = None
        if s.cls == "Embedding":
            out = ("zero", s.inputs[0]) if s.args.get("mask_zero") else None
        elif s.cls == "Masking":
            out = ("value", s.inputs[0], s.args["mask_value"])
        elif not got or s.cls in DROP:
            out = None
        elif s.cls in PASS:
            out = ins[0]
        elif s.cls in MERGE:
            if s.cls == "Concatenate" and s.args.get("axis", -1) not in (-1, len(s.out_shape)):
                _refuse(s, f"axis={s.args.get('axis')!r}", "a mask needs axis=-1")
            # Concatenate treats an unmasked input as all-true: the OR is then all-true too
            out = _or(got) if len(got) == len(ins) else None
        elif s.cls in RNN:
            out = ins[0] if _returns_sequences(s) else None
        elif s.cls == "GlobalAveragePooling1D":
            out = None
        elif s.cls == "MultiHeadAttention":
            out = ins[0]
        else:
            _refuse(s, "its input's mask", f"layers that take a mask: {', '.join(TAKES)}")
        if out is not None:
            masks[s.output] = out
    if any(t in masks for t in outputs):
        raise InvalidSpec(
            "model: the model's output still carries a mask (a masked sequence loss: Keras "
            "weights the loss at each position by it, which ringtrain does not yet); "
            "supported: a mask consumed inside the model (an RNN, GlobalAveragePooling1D), or "
            "a loss per position without mask_zero/Masking"
        )
    return masks


def readers(layers, masks: dict[int, Key]) -> list:
    """The layers whose computation reads a mask (``Masking`` and the :data:`CONSUME` layers
    with a masked input): what an exporter without masks must refuse."""
    return [
        s
        for s in layers
        if s.cls == "Masking" or (s.cls in CONSUME and any(t in masks for t in s.inputs))
    ]


def _returns_sequences(s) -> bool:
    a = s.args["layer"]["config"] if s.cls == "Bidirectional" else s.args
    return bool(a["return_sequences"])


def _refuse(s, what: str, supported: str) -> None:
    raise InvalidSpec(
        f"model: layer {s.name!r} ({s.cls}) receives a Keras mask (from Embedding(mask_zero="
        f"True) or Masking) and cannot honour {what} (supported: {supported})"
    )
