"""One Keras layer as parsed: :class:`LayerSpec`, :class:`InputSpec` and the checks that make them.

Pipeline position: below :mod:`.config` (Sequential) and :mod:`.functional` (Functional graphs),
which both turn a layer's JSON into a :class:`LayerSpec` here, through its registry entry; the
lowering and the exporters read the result. Pure: shape arithmetic on plain data.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras.entry import Args, Shape
from ringtrain_trainer.keras.registry import REGISTRY, SUPPORTED

FUNCTIONAL = ("Functional", "Model")
_INPUT_ARGS = ("batch_shape", "batch_input_shape", "input_shape", "shape", "batch_size", "optional")


@dataclass(frozen=True)
class LayerSpec:
    """One Keras layer: class, name, its normalized arguments (the registry entry's parse),
    the tensors it reads and writes, and their per-example shapes."""

    cls: str
    name: str
    args: dict = field(hash=False)
    inputs: tuple[int, ...]
    output: int
    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    #: the source config's ``dtype`` entry as written (a DTypePolicy config, a name, or None),
    #: so an export records the user's dtype policy per layer (``archive.to_keras``)
    dtype: Any = field(default=None, hash=False, compare=False)
    #: a later call of a shared layer (``keras.shared``): the layer whose weights it uses
    shares: str | None = None

    @property
    def frozen(self) -> bool:
        """``trainable=False`` on this layer or on a model around it (``keras.nested``)."""
        return self.args.get("trainable", True) is False


@dataclass(frozen=True)
class InputSpec:
    """One model input: its InputLayer's name, per-example shape, dtype and tensor (``-k``
    for the ``k``-th of ``input_layers``)."""

    name: str
    shape: Shape
    dtype: str
    tensor: int


def shape_of(cfg: dict) -> Shape | None:
    for key in ("batch_shape", "batch_input_shape"):
        if cfg.get(key) is not None:
            return tuple(cfg[key][1:])
    for key in ("input_shape", "shape"):
        if cfg.get(key) is not None:
            return tuple(cfg[key])
    return None


#: what a model's input may hold: floats, or integer ids (an Embedding's tokens; fed as float32
#: like every input, exact below 2**24)
INPUT_DTYPES = ("float32", "int32", "int64")


def input_dtype(layer: dict) -> str:
    v = (layer.get("config") or {}).get("dtype") or "float32"
    if isinstance(v, dict):
        v = (v.get("config") or {}).get("name") or "float32"
    return str(v)


def input_layer(layer: dict, index: int) -> tuple[str, Shape | None]:
    dtype = input_dtype(layer)
    cfg = {k: v for k, v in (layer.get("config") or {}).items() if k != "dtype"}
    a = Args({**layer, "config": cfg}, index)
    if dtype not in INPUT_DTYPES:
        a.refuse("dtype", dtype, ", ".join(INPUT_DTYPES))
    shape = shape_of(a.cfg)
    for k in (*_INPUT_ARGS, "sparse", "ragged", "input_tensor"):
        v = a.take(k)
        if k in ("sparse", "ragged", "input_tensor") and v:
            a.refuse(k, v, "False")
    a.done("shape")
    return a.name, shape


def check_shape(shape: Any) -> Shape:
    if shape is None or any(not isinstance(d, int) or d < 1 for d in shape):
        raise InvalidSpec(
            f"model: the input shape {shape} must be known and fixed "
            "(give the model an InputLayer with shape=..., or train it on data whose x "
            "fixes its None dimensions)"
        )
    return tuple(shape)


def unsupported(layer: Any, index: int) -> InvalidSpec:
    cls = layer.get("class_name") if isinstance(layer, dict) else None
    name = ((layer.get("config") or {}).get("name") if isinstance(layer, dict) else None) or index
    near = (
        difflib.get_close_matches(cls, SUPPORTED, n=3, cutoff=0.6) if isinstance(cls, str) else []
    )
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return InvalidSpec(
        f"model: layer {name!r} ({cls}) is not supported (supported layers: "
        f"{', '.join(SUPPORTED)}){hint}"
    )


def make_spec(
    layer: dict,
    index: int,
    inputs: tuple[int, ...],
    shapes: list[Shape],
    call: dict | None = None,
) -> LayerSpec:
    """Parse one layer's arguments through its entry and infer its output shape; ``call``:
    the Functional node's call arguments, read by the entry if it takes them (``call_args``)."""
    cls = layer.get("class_name")
    if not isinstance(cls, str) or (entry := REGISTRY.get(cls)) is None:
        raise unsupported(layer, index)
    a = Args(layer, index)
    for k, v in (call or {}).items():
        if k not in entry.call_args:
            supported = ", ".join(entry.call_args) or "none"
            raise InvalidSpec(
                f"model: {a.where}: call argument {k}={v!r} is not supported "
                f"(supported: {supported})"
            )
        a.cfg[k] = v
    for k in ("batch_input_shape", "input_shape", "batch_size"):
        a.take(k)
    a.activity()
    args = {**entry.parse(a), **a.extra}
    n = len(inputs)
    if (entry.inputs and n != entry.inputs) or (not entry.inputs and n < 2):
        want = entry.inputs or "2 or more"
        raise InvalidSpec(f"model: {a.where}: called on {n} tensors (supported: {want})")
    try:
        out = tuple(entry.infer(args, shapes))
    except ValueError as e:
        raise InvalidSpec(f"model: {a.where}: {e}") from None
    dtype = copy.deepcopy((layer.get("config") or {}).get("dtype"))
    return LayerSpec(cls, a.name, args, inputs, index + 1, tuple(shapes), out, dtype)
