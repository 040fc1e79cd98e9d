"""What a checkpoint must hold before anything uses it: its manifest's fields in range, its
arrays finite floats of sane shapes, nothing else (issue 35).

Why: the checksum proves that the ``.npz`` is the one the manifest names, not that either is
sane — anyone who can write the directory can write both. A forged but checksum-valid
checkpoint (complex parameters, step -5 or 10^400, a missing key, an object array, an extra
array of a gigabyte declared in a 300-byte ``.npy`` header) ended in a traceback, and a
checkpoint whose parameters were NaN was resumed. Every such checkpoint is now a
:class:`CheckpointError` naming the file, so ``CheckpointManager.load_latest`` falls back to
the previous good one exactly as for a corrupt one.

What is checked: every counter is an integer in ``[0, MAX_STEPS]`` (the worker broadcasts
them as float32, exact only below 2^24, and no run may ask for more steps); the strings are
strings and the records dicts; the ``.npz`` is a zip of stored (uncompressed) ``.npy`` members,
only ``params``, ``model_state`` and ``opt_<slot>``, each one-dimensional of a real floating
dtype whose header agrees with its size — checked on the headers, before any array is
allocated —, and every value finite. Whether it fits *this* run (model, shapes, optimizer) is
the reader's ``check`` (``worker_checkpoint.Checkpointing._fits``).
"""

from __future__ import annotations

import io
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.errors import CheckpointError
from ringtrain.options import MAX_STEPS
from ringtrain_trainer.data.arrays import npy_header

#: the dynamic loss scale's array (``optim.loss_scale.STATE_KEY``): [scale, counter]
LOSS_SCALE = "opt_loss_scale"
#: an optimizer slot's name as the ``.npz`` keeps it
_SLOT = re.compile(r"^opt_[A-Za-z_][A-Za-z0-9_]{0,63}$")
#: more workers than any ring has; the number is only reported
MAX_WORLD = 1 << 16
#: examples per step, summed over the workers (a position counts in them)
MAX_GLOBAL_BATCH = 1 << 31
_COUNTERS = ("step", "epoch", "batch", "optimizer_iterations")


def _count(m: dict, key: str, lo: int, hi: int, where: Path) -> int:
    v = m.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        got = "missing" if key not in m else f"{type(v).__name__} {_short(v)}"
        raise CheckpointError(f"{where}: {key!r} is {got}, not an integer")
    if not lo <= v <= hi:
        raise CheckpointError(f"{where}: {key!r} is {_short(v)}, outside [{lo}, {hi}]")
    return v


def _short(v: Any) -> str:
    s = (
        repr(v)
        if not isinstance(v, int) or v.bit_length() < 200
        else f"an int of {v.bit_length()} bits"
    )
    return s if len(s) <= 60 else s[:57] + "..."


def _typed(m: dict, key: str, types: tuple[type, ...], where: Path, required: bool = False) -> Any:
    if key not in m and not required:
        return None
    v = m.get(key)
    if (v is None and not required) or isinstance(v, types):
        return v
    want = " or ".join(t.__name__ for t in types)
    got = "missing" if key not in m else type(v).__name__
    raise CheckpointError(f"{where}: {key!r} is {got}, not {want}")


def manifest(m: Any, where: Path) -> dict[str, Any]:
    """The manifest's fields, each checked (a :class:`CheckpointError` naming ``where`` and the
    field otherwise): counters, strings, records and the loss."""
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: a manifest is a JSON object, not {type(m).__name__}")
    out: dict[str, Any] = {k: _count(m, k, 0, MAX_STEPS, where) for k in _COUNTERS}
    out["global_batch"] = _count(m, "global_batch", 0, MAX_GLOBAL_BATCH, where)
    out["world_size"] = _count(m, "world_size", 1, MAX_WORLD, where)
    for key in ("model", "optimizer"):
        out[key] = _typed(m, key, (str,), where, required=True)
    out["precision"] = _typed(m, "precision", (str,), where)
    for key in ("optimizer_config", "loss_config"):
        out[key] = _typed(m, key, (dict,), where)
    rec = out["optimizer_config"]
    if rec is not None and not (
        isinstance(rec.get("name"), str)
        and isinstance(rec.get("keras"), dict)
        and isinstance(rec["keras"].get("class_name"), str)
        and isinstance(rec.get("step_decay") or {}, dict)
    ):
        raise CheckpointError(f"{where}: 'optimizer_config' is not an optimizer's record")
    loss = m.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float)):
        raise CheckpointError(f"{where}: 'loss' is {type(loss).__name__}, not a number")
    out["loss"] = None if loss is None else float(loss)
    return out


def _allowed(key: str) -> bool:
    return key in ("params", "model_state") or bool(_SLOT.match(key))


def _header(f, npz: Path, key: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        shape, _, dtype = npy_header(f)
    except (ValueError, SyntaxError, TypeError, EOFError, OverflowError) as e:
        raise CheckpointError(f"{npz}: array {key!r}: bad .npy header ({e})") from None
    if dtype.kind != "f" or dtype.hasobject or dtype.itemsize > 8:
        raise CheckpointError(
            f"{npz}: array {key!r} is {dtype} ({dtype.kind!r}); a checkpoint holds real floats"
        )
    if len(shape) != 1:
        raise CheckpointError(f"{npz}: array {key!r} has shape {shape}; a checkpoint's are flat")
    return shape, dtype


def arrays(blob: bytes, npz: Path) -> dict[str, np.ndarray]:
    """The ``.npz``'s arrays, each checked before it is read: stored members named
    ``params``/``model_state``/``opt_<slot>`` only, flat real floats whose ``.npy`` header
    accounts for exactly the member's size (so nothing is allocated beyond the file the cap
    bounded); then every value finite."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
        infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointError(f"{npz}: not a valid .npz ({e})") from None
    out: dict[str, np.ndarray] = {}
    for info in infos:
        key = info.filename.removesuffix(".npy")
        if not info.filename.endswith(".npy") or not _allowed(key):
            raise CheckpointError(
                f"{npz}: holds {_short(info.filename)}; a checkpoint holds only params, "
                "model_state and opt_<slot> arrays"
            )
        if key in out:
            raise CheckpointError(f"{npz}: holds {key!r} twice")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(blob):
            raise CheckpointError(
                f"{npz}: array {key!r} is compressed or larger than the file "
                f"({info.file_size} bytes); a checkpoint's are stored as written"
            )
        try:
            with zf.open(info) as f:
                shape, dtype = _header(f, npz, key)
                if f.tell() + math.prod(shape) * dtype.itemsize != info.file_size:
                    raise CheckpointError(
                        f"{npz}: array {key!r}: its header says {shape} {dtype}, its member "
                        f"holds {info.file_size} bytes"
                    )
                f.seek(0)
                out[key] = np.lib.format.read_array(f, allow_pickle=False)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise CheckpointError(f"{npz}: array {key!r} unreadable ({e})") from None
    if "params" not in out:
        raise CheckpointError(f"{npz}: no 'params' array")
    ls = out.get(LOSS_SCALE)
    if ls is not None and (ls.shape != (2,) or not ls[0] > 0 or not 0 <= ls[1] <= MAX_STEPS):
        raise CheckpointError(f"{npz}: loss scale {ls.tolist()!r} is not [scale > 0, counter]")
    for key, a in out.items():
        finite(npz, key, a)
    return out


def finite(npz: Path | str, key: str, a: np.ndarray) -> None:
    """A :class:`CheckpointError` naming the file, the array and its first non-finite value
    unless every value of ``a`` is finite (a NaN checkpoint is skipped like a corrupt one)."""
    if np.isfinite(a).all():
        return
    bad = np.flatnonzero(~np.isfinite(a))
    what = (
        "params"
        if key == "params"
        else "model state"
        if key == "model_state"
        else ("optimizer state " + repr(key.removeprefix("opt_")))
    )
    raise CheckpointError(
        f"{npz}: non-finite {what}: {bad.size} of {a.size} values (the first, index "
        f"{int(bad[0])}, is {a.flat[bad[0]]}); not resumed"
    )
