"""``ringtrain data inspect``: what a data set holds, read as the trainer or ``convert`` reads it.

Pipeline position: before training or converting. A ``.npz`` is described by its members'
``.npy`` headers (nothing else is read); shards by :func:`.shards.load_sharded`, so every
refusal the trainer would make is made here first; TFRecord files by reading every record
(checksums verified, each ``tf.train.Example`` decoded), since a record's features are known
only by decoding it — the kinds and value counts of each feature over all records are what
``convert``'s mapping (``--x``/``--y``, ``--x-shape``) is chosen from.
"""

from __future__ import annotations

import os
import zipfile
from collections import Counter
from pathlib import Path

from ringtrain.errors import DataError
from ringtrain_trainer.data.arrays import npy_header
from ringtrain_trainer.data.example import WireError, decode
from ringtrain_trainer.data.images import index, is_image_folder, pil
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.data.shards import load_sharded, shard_files
from ringtrain_trainer.data.tfrecord import GZIP_MAGIC, blocks, tfrecord_files


def describe(path: str | os.PathLike) -> dict:
    """A JSON-able description of the data set at ``path`` (see the module)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".npz":
        return _npz(p)
    if is_image_folder(p):
        return _images(p)
    tf = tfrecord_files(path)
    if tf is not None and shard_files(path) is None:
        return _tfrecord(tf)
    if shard_files(path) is not None:
        return _shards(path)
    raise DataError(
        f"{path}: neither a .npz file, a directory or glob of .npy/.npz shards, TFRecord files "
        "nor an image folder"
    )


def _npz(path: Path) -> dict:
    arrays = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                with z.open(info) as f:
                    try:
                        shape, _, dtype = npy_header(f)
                    except ValueError as e:
                        raise DataError(f"{path}: {info.filename}: not a .npy ({e})") from None
                arrays[info.filename.removesuffix(".npy")] = {
                    "shape": list(shape),
                    "dtype": str(dtype),
                    "bytes": info.file_size,
                    "compressed": info.compress_type != zipfile.ZIP_STORED,
                }
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz archive ({e})") from None
    return {"path": str(path), "format": "npz", "bytes": path.stat().st_size, "arrays": arrays}


def _shards(path) -> dict:
    files = shard_files(path) or []
    ds = load_sharded(path)
    splits = {}
    try:
        for name, split in (("train", ds.train), ("test", ds.test)):
            x, y = split.images, split.labels
            splits[name] = {
                "rows": len(x),
                "shards": len(x.parts) if isinstance(x, ShardedArray) else 1,
                "x": {"shape": list(x.shape[1:]), "dtype": str(x.dtype)},
                "y": {"shape": list(y.shape[1:]), "dtype": str(y.dtype)},
            }
    finally:
        for split in (ds.train, ds.test):
            if isinstance(split.images, ShardedArray):
                split.images.close()
    return {
        "path": str(path),
        "format": "npy-shards",
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "splits": splits,
    }


def _tfrecord(files: list[Path]) -> dict:
    features: dict[str, dict] = {}
    per_file, total = [], 0
    for path in files:
        n = 0
        for block in blocks(path):
            for i in range(len(block)):
                try:
                    feats = decode(block.record(i))
                except WireError as e:
                    raise DataError(
                        f"{path}: record {block.first + i}: not a tf.train.Example ({e})"
                    ) from None
                for name, f in feats.items():
                    d = features.setdefault(name, {"kinds": set(), "records": 0, "counts": set()})
                    d["kinds"].add(f.kind)
                    d["records"] += 1
                    count = len(f.values[0]) if f.kind == "bytes_list" and len(f) == 1 else len(f)
                    d["counts"].add(count)
            n += len(block)
        per_file.append({"file": str(path), "records": n, "gzip": _gzip(path)})
        total += n
    out = {}
    for name, d in sorted(features.items()):
        kinds = sorted(k or "none" for k in d["kinds"])
        unit = "bytes" if kinds == ["bytes_list"] else "values"
        out[name] = {
            "kind": kinds[0] if len(kinds) == 1 else kinds,
            unit: sorted(d["counts"])[0] if len(d["counts"]) == 1 else _range(d["counts"]),
            "in_records": d["records"],
        }
    return {
        "path": str(files[0].parent) if len(files) > 1 else str(files[0]),
        "format": "tfrecord",
        "files": len(files),
        "records": total,
        "bytes": sum(f.stat().st_size for f in files),
        "per_file": per_file,
        "features": out,
    }


def _images(root: Path) -> dict:
    """Classes and their image counts, and the images' sizes and modes (headers only)."""
    image, unidentified = pil()
    classes, files = index(root)
    per_class = Counter(classes[label] for _, label in files)
    sizes: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    for f, _ in files:
        try:
            with image.open(f) as im:
                sizes[f"{im.size[1]}x{im.size[0]}"] += 1
                modes[im.mode] += 1
        except (unidentified, OSError) as e:
            raise DataError(f"{f}: not an image Pillow can read ({e})") from None
    return {
        "path": str(root),
        "format": "image-folder",
        "files": len(files),
        "bytes": sum(f.stat().st_size for f, _ in files),
        "classes": {c: per_class[c] for c in classes},
        "sizes_hxw": dict(sizes.most_common()),
        "modes": dict(modes.most_common()),
    }


def _range(counts: set[int]) -> list[int]:
    return [min(counts), max(counts)]


def _gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _n(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def text(d: dict) -> str:
    """``d`` (from :func:`describe`) for a terminal."""
    size = f"{d['bytes'] / 1e6:.1f} MB"
    if d["format"] == "npz":
        lines = [f"{d['path']}: .npz, {len(d['arrays'])} arrays, {size}"]
        for k, a in d["arrays"].items():
            z = ", compressed" if a["compressed"] else ""
            lines.append(f"  {k:<10} {a['dtype']:<8} {tuple(a['shape'])}{z}")
        return "\n".join(lines)
    if d["format"] == "image-folder":
        return "\n".join(
            [
                f"{d['path']}: image folder, {_n(d['files'], 'image')} in "
                f"{_n(len(d['classes']), 'class')}, {size}",
                "  classes (label order): "
                + ", ".join(f"{c} ({n})" for c, n in d["classes"].items()),
                "  sizes (HxW): " + ", ".join(f"{k} ({n})" for k, n in d["sizes_hxw"].items()),
                "  modes: " + ", ".join(f"{k} ({n})" for k, n in d["modes"].items()),
            ]
        )
    if d["format"] == "npy-shards":
        lines = [f"{d['path']}: .npy/.npz shards, {_n(d['files'], 'file')}, {size}"]
        for k, s in d["splits"].items():
            lines.append(
                f"  {k:<6} {s['rows']} rows in {_n(s['shards'], 'shard')}: x {s['x']['dtype']} "
                f"{tuple(s['x']['shape'])}, y {s['y']['dtype']} {tuple(s['y']['shape'])}"
            )
        return "\n".join(lines)
    lines = [f"{d['path']}: TFRecord, {_n(d['files'], 'file')}, {d['records']} records, {size}"]
    for k, f in d["features"].items():
        unit = "bytes" if "bytes" in f else "values"
        n = f[unit]  # a count, or [fewest, most] when records differ
        many = f"{n[0]}-{n[1]} {unit}" if isinstance(n, list) else _n(n, unit[:-1])
        lines.append(f"  {k:<12} {f['kind']!s:<11} {many}, in {_n(f['in_records'], 'record')}")
    return "\n".join(lines)
