"""Keras configs and ``.keras`` archives out of a :class:`~.config.ModelConfig`, and back.

Pipeline position: ``--model model.keras`` reads an archive here (its weights become the
starting point); ``ringtrain export`` writes one. The layout is Keras' own ``saving_lib``: a
zip of ``metadata.json``, ``config.json`` (with ``compile_config`` when present) and
``model.weights.h5``, where a model's layer list is saved as a container — each layer's arrays
under ``layers/<snake_case(class)>[_k]/vars/0..n``, numbered per class in layer order. A
Sequential model's list leaves out its InputLayer; a Functional model's includes it (Keras
3.15's ``model.layers``). Arrays are in ``get_weights()`` order, the registry entries'
``weights``. Checked against files Keras 3.15 writes and by ``keras.saving.load_model``.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from ringtrain import files
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import nested, shared
from ringtrain_trainer.keras.config import ModelConfig, fix_input_shape, free_input_shape, parse
from ringtrain_trainer.keras.entry import Weight, snake_case
from ringtrain_trainer.keras.layer_spec import InputSpec
from ringtrain_trainer.keras.registry import REGISTRY

CONFIG, METADATA, WEIGHTS = "config.json", "metadata.json", "model.weights.h5"
#: the oldest Keras that reads this layout (the saving format has not changed since 3.0)
KERAS_VERSION = "3.0.0"
#: the ``module`` Keras 3 writes for each model class (it deserializes Functional only from it)
_MODULE = {"Sequential": "keras", "Functional": "keras.src.models.functional"}
#: a layer's ``dtype`` as Keras 3 writes it under ``set_global_policy("mixed_float16")``
MIXED_FLOAT16 = {
    "module": "keras",
    "class_name": "DTypePolicy",
    "config": {"name": "mixed_float16"},
    "registered_name": None,
}


def weights_of_layer(s) -> list[Weight]:
    """One layer's arrays, in ``get_weights()`` order (none for a later call of a shared
    layer: ``keras.shared``)."""
    return [] if s.shares else REGISTRY[s.cls].weights(s.args, list(s.in_shapes))


def weights_of(cfg: ModelConfig) -> list[tuple[str, list[Weight]]]:
    """Each layer's name with its arrays, in ``get_weights()`` order."""
    return [(s.name, weights_of_layer(s)) for s in cfg.layers]


def bind(cfg: ModelConfig, weights: list[np.ndarray]) -> list[list[np.ndarray]]:
    """``weights`` (``get_weights()`` order) split per layer, the count and every shape checked
    so a mismatch names the layer instead of corrupting a file."""
    want = weights_of(cfg)
    need = sum(len(w) for _, w in want)
    if len(weights) != need:
        raise InvalidSpec(f"model has {need} weight arrays but {len(weights)} were given")
    it, out = iter(weights), list[list[np.ndarray]]()
    for s, (_, ws) in zip(cfg.layers, want, strict=True):
        out.append([])
        for i, w in enumerate(ws):
            arr = np.asarray(next(it), dtype=np.float32)
            if tuple(arr.shape) != tuple(w.shape):
                raise InvalidSpec(
                    f"layer {s.name!r} ({s.cls}): weight {i} has shape {tuple(arr.shape)}, "
                    f"expected {tuple(w.shape)}"
                )
            out[-1].append(arr)
    at = {s.name: i for i, s in enumerate(cfg.layers)}
    return [out[at[s.shares]] if s.shares else a for s, a in zip(cfg.layers, out, strict=True)]


def h5_paths(cfg: ModelConfig) -> list[str | None]:
    """Per layer of ``cfg.layers``, its ``model.weights.h5`` group (a nested model's layers:
    where ``keras.nested`` found them)."""
    if cfg.nesting.h5:
        return [None if s.shares else cfg.nesting.h5[s.name] for s in cfg.layers]
    used: dict[str, int] = {"input_layer": 0} if cfg.functional else {}
    paths: list[str | None] = []
    for s in cfg.layers:
        if s.shares:
            paths.append(None)
            continue
        base = snake_case(s.cls)
        n = used.get(base, -1) + 1
        used[base] = n
        paths.append(f"layers/{base}" + (f"_{n}" if n else ""))
    return paths


def _slots(group: str, ws: list[Weight]) -> list[tuple[str, int]]:
    """Where each of a layer's arrays lives in ``model.weights.h5``: (its ``vars`` group, its
    index there); a weight of a Keras sub-layer (``Weight.group``) is numbered within it."""
    seen: dict[str, int] = {}
    out = []
    for w in ws:
        where = f"{group}/{w.group}/vars" if w.group else f"{group}/vars"
        seen[where] = seen.get(where, -1) + 1
        out.append((where, seen[where]))
    return out


def _item(cls: str, config: dict, **extra) -> dict:
    module = REGISTRY[cls].module if cls in REGISTRY else "keras.layers"
    return {
        "module": module,
        "class_name": cls,
        "config": config,
        "registered_name": None if module == "keras.layers" else cls,
        **extra,
    }


def layer_dtype(cfg: ModelConfig, s, precision: str | None = None):
    """The ``dtype`` a layer is exported with: a mixed_float16 model's layers keep what the
    source said (its float32 softmax stays float32); a float32 model trained with
    ``--precision fp16`` computed every layer in float16, so each gets mixed_float16; else
    float32. The weights stay float32 either way: Keras' master weights under mixed_float16."""
    if cfg.numerics.policy == "mixed_float16":
        return copy.deepcopy(MIXED_FLOAT16 if s.dtype is None else s.dtype)
    return copy.deepcopy(MIXED_FLOAT16) if precision == "fp16" else "float32"


def to_keras(
    cfg: ModelConfig, compile_config: dict | None = None, precision: str | None = None
) -> dict:
    """A Keras 3 config (``model.to_json()``'s shape) that ``model_from_json`` loads;
    ``precision``: the run's (``numerics.Numerics.precision``), for :func:`layer_dtype`."""
    inp = {"batch_shape": [None, *cfg.input_shape], "dtype": cfg.input_dtype}
    inp["name"] = cfg.input_name
    calls = [REGISTRY[s.cls].call_args for s in cfg.layers]
    layers = [
        _item(
            s.cls,
            {"name": s.name, "dtype": layer_dtype(cfg, s, precision)}
            | ({"trainable": True} if REGISTRY[s.cls].takes_trainable else {})
            | {k: v for k, v in s.args.items() if k not in call},
        )
        for s, call in zip(cfg.layers, calls, strict=True)
    ]
    if cfg.functional:
        ins = cfg.inputs or (InputSpec(cfg.input_name, cfg.input_shape, cfg.input_dtype, 0),)
        names = {x.tensor: [x.name, 0, 0] for x in ins}
        names |= {s.output: shared.history(s.name, s.shares) for s in cfg.layers}
        shapes = {x.tensor: x.shape for x in ins} | {s.output: s.out_shape for s in cfg.layers}
        dtypes = {x.tensor: x.dtype for x in ins}

        def tensor(t: int) -> dict:
            return {
                "class_name": "__keras_tensor__",
                "config": {
                    "shape": [None, *shapes[t]],
                    "dtype": dtypes.get(t, "float32"),
                    "keras_history": names[t],
                },
            }

        for item, s, call in zip(layers, cfg.layers, calls, strict=True):
            ts = [tensor(t) for t in s.inputs]
            item["name"] = s.name
            args = ts if REGISTRY[s.cls].positional else [ts if len(ts) > 1 else ts[0]]
            kwargs = {k: s.args[k] for k in call if s.args.get(k)}
            item["inbound_nodes"] = [{"args": args, "kwargs": kwargs}]
        firsts = [
            _item(
                "InputLayer",
                {"batch_shape": [None, *x.shape], "dtype": x.dtype, "name": x.name},
                name=x.name,
                inbound_nodes=[],
            )
            for x in ins
        ]
        outs = cfg.outputs or (cfg.output,)
        in_refs = [[x.name, 0, 0] for x in ins]
        out_refs = [names[t] for t in outs]
        body = {
            "layers": [*firsts, *shared.fold(layers, cfg.layers)],
            "input_layers": in_refs if len(in_refs) > 1 else in_refs[0],
            "output_layers": out_refs if len(out_refs) > 1 else out_refs[0],
        }
        cls = "Functional"
    else:
        body = {"layers": [_item("InputLayer", inp), *layers]}
        cls = "Sequential"
    out = {
        "module": _MODULE[cls],
        "class_name": cls,
        "config": {"name": cfg.name, "trainable": True, "dtype": "float32", **body},
        "registered_name": None,
        "build_config": {"input_shape": _build_shape(cfg)},
    }
    if compile_config is not None:
        out["compile_config"] = compile_config
    return nested.nest(out, cfg.nesting)


def _build_shape(cfg: ModelConfig) -> list:
    """``build_config.input_shape``: one shape, or one per input as Keras writes them."""
    shapes = [[None, *x.shape] for x in cfg.inputs] or [[None, *cfg.input_shape]]
    return shapes if len(shapes) > 1 else shapes[0]


def normalized(keras_config: dict) -> dict:
    """A copy with the ``module`` fields and ``build_config`` Keras writes itself, so a config
    written by hand (or by tf.keras 2) deserializes like one Keras saved."""
    cfg = copy.deepcopy(keras_config)
    cls = cfg.get("class_name")
    cfg.setdefault("module", _MODULE.get(cls, "keras") if isinstance(cls, str) else "keras")
    cfg.setdefault("registered_name", None)
    for layer in (cfg.get("config") or {}).get("layers") or []:
        layer.setdefault("module", "keras.layers")
        layer.setdefault("registered_name", None)
    cfg.setdefault(
        "build_config", {"input_shape": _build_shape(parse(_any_length(keras_config), False))}
    )
    return cfg


def _h5py():
    try:
        import h5py
    except ImportError:
        raise InvalidSpec("the .keras format needs the h5py package (pip install h5py)") from None
    return h5py


def write_keras(
    path: str | os.PathLike,
    keras_config: dict,
    weights: list[np.ndarray],
    compile_config: dict | None = None,
) -> Path:
    """Write a ``.keras`` archive that ``keras.saving.load_model`` opens: ``keras_config`` as
    ``json.loads(model.to_json())``, ``weights`` in ``get_weights()`` order; ``compile_config``
    (or the config's own) makes Keras compile the loaded model with that loss and optimizer."""
    cfg = parse(_any_length(keras_config), compiled=False)
    arrays = bind(cfg, weights)
    doc = normalized(keras_config)
    if compile_config is not None:
        doc["compile_config"] = compile_config
    h5py = _h5py()
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.create_group("vars").attrs["name"] = cfg.name
        if cfg.functional:
            f.create_group("layers/input_layer/vars")
        for empty in cfg.nesting.empty:
            f.require_group(empty)
        for s, group, ws, (_, specs) in zip(
            cfg.layers, h5_paths(cfg), arrays, weights_of(cfg), strict=True
        ):
            if group is None:  # a later call of a shared layer: its weights are the layer's
                continue
            f.create_group(f"{group}/vars").attrs["name"] = s.name
            for (where, i), w, spec in zip(_slots(group, specs), ws, specs, strict=True):
                f.require_group(where).create_dataset(str(i), data=w.astype(spec.dtype))
    metadata = {
        "keras_version": KERAS_VERSION,
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr(METADATA, json.dumps(metadata))
        zf.writestr(CONFIG, json.dumps(doc))
        zf.writestr(WEIGHTS, buf.getvalue())
    return files.atomic_write(path, out.getvalue())


#: the length a free (None) input dimension takes to read a model's weights: their shapes do
#: not depend on it (the run fixes it from the data, ``keras.config.fix_input_shape``)
ANY_LENGTH = 1024
#: a model's config.json: Keras' own for a thousand-layer model is a few MiB
MAX_CONFIG_BYTES = 16 << 20
#: what an HDF5 weights file adds to its arrays (its groups, names and attributes)
H5_OVERHEAD_BYTES = 16 << 20


def _any_length(doc: dict) -> dict:
    free = free_input_shape(doc)
    if free is None:
        return doc
    return fix_input_shape(doc, tuple(ANY_LENGTH if d is None else d for d in free))


def _bounded(zf: zipfile.ZipFile, name: str, limit: int, path: Path, why: str) -> bytes:
    """A member read only if its stated size is within ``limit`` (zipfile stops at the stated
    size and checks the CRC, so a member cannot inflate beyond what it states)."""
    size = zf.getinfo(name).file_size
    if size > limit:
        raise InvalidSpec(f"{path}: {name} is {size:,} bytes uncompressed, over {limit:,} ({why})")
    return zf.read(name)


def read_keras(
    path: str | os.PathLike, max_weight_bytes: int | None = None
) -> tuple[dict, list[np.ndarray]]:
    """The inverse of :func:`write_keras` for any ``.keras`` file of a supported model (Keras'
    own included): its config and weights in ``get_weights()`` order. Every member is bounded
    before it is inflated (a zip bomb of a config.json cost 5.7 GB, issue 35): the config by
    :data:`MAX_CONFIG_BYTES`, the weights by what the config's arrays can take in float64 plus
    HDF5's overhead, and by ``max_weight_bytes`` (the IPU's memory, where known)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            for need in (CONFIG, WEIGHTS):
                if need not in names:
                    raise InvalidSpec(
                        f"{path}: no {need} in the archive (not a Keras 3 .keras file?)"
                    )
            doc = json.loads(_bounded(zf, CONFIG, MAX_CONFIG_BYTES, path, "a model's config"))
            try:
                cfg = parse(_any_length(doc), compiled=False)
            except InvalidSpec as e:
                raise InvalidSpec(f"--model {path}: {e}") from None
            values = sum(math.prod(w.shape) for _, ws in weights_of(cfg) for w in ws)
            limit = 8 * values + H5_OVERHEAD_BYTES
            why = f"{values:,} weights at 8 bytes at most, and HDF5's overhead"
            if max_weight_bytes is not None and max_weight_bytes + H5_OVERHEAD_BYTES < limit:
                limit, why = max_weight_bytes + H5_OVERHEAD_BYTES, "the IPU's memory"
            blob = _bounded(zf, WEIGHTS, limit, path, why)
    except FileNotFoundError:
        raise InvalidSpec(f"{path}: no such file") from None
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise InvalidSpec(f"{path}: not a readable .keras archive ({e})") from None
    h5py = _h5py()
    weights: list[np.ndarray] = []
    try:
        with h5py.File(io.BytesIO(blob), "r") as f:
            for (name, ws), group in zip(weights_of(cfg), h5_paths(cfg), strict=True):
                if group is None:  # a later call of a shared layer
                    continue
                for where, i in _slots(group, ws):
                    g = f.get(where)
                    if g is None or str(i) not in g:
                        raise InvalidSpec(
                            f"{path}: {WEIGHTS} has no {where}/{i} for layer {name!r}"
                        )
                    weights.append(np.asarray(g[str(i)]))
    except OSError as e:
        raise InvalidSpec(f"{path}: {WEIGHTS} is not readable HDF5 ({e})") from None
    try:
        bind(cfg, weights)
    except InvalidSpec as e:
        raise InvalidSpec(f"{path}: {e}") from None
    return doc, weights
