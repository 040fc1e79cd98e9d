"""The Keras 3 ``.keras`` archive, written and read without importing Keras.

Pipeline position: ``ringtrain export`` writes one from a checkpoint; ``--model model.keras``
reads one back to fine-tune from it. The layout is Keras' own ``saving_lib``: a zip holding
``metadata.json``, ``config.json`` (the model config, with ``compile_config`` when present) and
``model.weights.h5``, where the weights of the i-th non-input layer of a Sequential live in
``layers/<snake_case(class)>[_k]/vars/0..n`` — named after the layer's *class*, numbered per
class in order (``conv2d``, ``conv2d_1``), not after the layer's name, because Keras addresses
a list of layers that way (``_save_container_state``). Variables are in the layer's own order,
which for every supported layer is ``get_weights()``'s. Checked against files Keras 3.15
writes and loaded by ``keras.saving.load_model`` in the tests.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.export.layers import bind, input_shape, sequential_layers, snake_case

CONFIG, METADATA, WEIGHTS = "config.json", "metadata.json", "model.weights.h5"
#: the oldest Keras that reads this layout (the saving format has not changed since 3.0)
KERAS_VERSION = "3.0.0"


def _h5py():
    try:
        import h5py
    except ImportError:
        raise InvalidSpec("the .keras format needs the h5py package (pip install h5py)") from None
    return h5py


def normalized_config(keras_config: dict) -> dict:
    """A copy with the ``module`` fields and ``build_config`` Keras writes itself, so a config
    written by hand (or by tf.keras 2) deserializes like one Keras saved."""
    cfg = copy.deepcopy(keras_config)
    cfg.setdefault("module", "keras")
    cfg.setdefault("registered_name", None)
    for layer in sequential_layers(cfg):
        layer.setdefault("module", "keras.layers")
        layer.setdefault("registered_name", None)
    cfg.setdefault("build_config", {"input_shape": [None, *input_shape(cfg)]})
    return cfg


def h5_paths(keras_config: dict) -> list[str]:
    """The weights group of every non-input layer, in layer order."""
    used: dict[str, int] = {}
    paths = []
    for layer in sequential_layers(keras_config):
        if layer.get("class_name") == "InputLayer":
            continue
        base = snake_case(layer["class_name"])
        used[base] = used.get(base, -1) + 1
        paths.append(f"layers/{base}" + (f"_{used[base]}" if used[base] else ""))
    return paths


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_keras(
    path: str | os.PathLike,
    keras_config: dict,
    weights: list[np.ndarray],
    compile_config: dict | None = None,
) -> Path:
    """Write a ``.keras`` archive that ``keras.saving.load_model`` opens.

    ``keras_config`` is a Keras 3 Sequential config (``json.loads(model.to_json())``),
    ``weights`` are in ``model.get_weights()`` order; ``compile_config`` (or the config's own)
    makes Keras compile the loaded model with that loss and optimizer.
    """
    layers = bind(keras_config, weights)
    cfg = normalized_config(keras_config)
    if compile_config is not None:
        cfg["compile_config"] = compile_config
    h5py = _h5py()
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.create_group("vars").attrs["name"] = cfg.get("config", {}).get("name", "sequential")
        for layer, group in zip(layers, h5_paths(cfg), strict=True):
            g = f.create_group(group).create_group("vars")
            g.attrs["name"] = layer.name
            for i, w in enumerate(layer.weights):
                g.create_dataset(str(i), data=w)
    metadata = {
        "keras_version": KERAS_VERSION,
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr(METADATA, json.dumps(metadata))
        zf.writestr(CONFIG, json.dumps(cfg))
        zf.writestr(WEIGHTS, buf.getvalue())
    path = Path(path)
    _atomic_write(path, out.getvalue())
    return path


def read_keras(path: str | os.PathLike) -> tuple[dict, list[np.ndarray]]:
    """The inverse of :func:`write_keras` for any ``.keras`` file of a supported Sequential
    model (Keras' own included): its config and weights in ``get_weights()`` order."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            for need in (CONFIG, WEIGHTS):
                if need not in names:
                    raise InvalidSpec(
                        f"{path}: no {need} in the archive (not a Keras 3 .keras file?)"
                    )
            cfg = json.loads(zf.read(CONFIG))
            blob = zf.read(WEIGHTS)
    except FileNotFoundError:
        raise InvalidSpec(f"{path}: no such file") from None
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise InvalidSpec(f"{path}: not a readable .keras archive ({e})") from None
    h5py = _h5py()
    weights: list[np.ndarray] = []
    try:
        with h5py.File(io.BytesIO(blob), "r") as f:
            for group in h5_paths(cfg):
                g = f.get(f"{group}/vars")
                if g is not None:
                    weights += [np.asarray(g[k]) for k in sorted(g.keys(), key=int)]
    except OSError as e:
        raise InvalidSpec(f"{path}: {WEIGHTS} is not readable HDF5 ({e})") from None
    try:
        bind(cfg, weights)
    except InvalidSpec as e:
        raise InvalidSpec(f"{path}: {e}") from None
    return cfg, weights
