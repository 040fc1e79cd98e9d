"""``ringtrain data inspect``: what a data set holds, read as the trainer or ``convert`` reads it.

Pipeline position: before training or converting. A ``.npz`` is described by its members'
``.npy`` headers (nothing else is read); shards by :func:`.shards.load_sharded`, so every
refusal the trainer would make is made here first; TFRecord files by reading every record
(checksums verified, each ``tf.train.Example`` decoded), since a record's features are known
only by decoding it — the kinds and value counts of each feature over all records are what
``convert``'s mapping (``--x``/``--y``, ``--x-shape``) is chosen from. Parquet files likewise
(:mod:`.parquet`): the schema says each column's type, but a list's length is per row, so
every row group is read, one at a time.
"""

from __future__ import annotations

import os
import zipfile
from collections import Counter
from pathlib import Path

from ringtrain.errors import DataError
from ringtrain_trainer.data.arrays import npy_header
from ringtrain_trainer.data.images import index, is_image_folder, pil
from ringtrain_trainer.data.parquet import (
    batches,
    kind_of,
    lengths,
    nulls,
    open_file,
    parquet_files,
)
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.data.shards import load_sharded, shard_files
from ringtrain_trainer.data.tfrecord import GZIP_MAGIC, examples, tfrecord_files


def describe(path: str | os.PathLike) -> dict:
    """A JSON-able description of the data set at ``path`` (see the module)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".npz":
        return _npz(p)
    if is_image_folder(p):
        return _images(p)
    shards = shard_files(path)  # a glob's: every file it matches
    if not shards or not any(f.suffix in (".npz", ".npy") for f in shards):
        tf = tfrecord_files(path)
        if tf is not None:
            return _tfrecord(tf)
        pq = parquet_files(path)
        if pq is not None:
            return _parquet(pq)
    if shards is not None:
        return _shards(path)
    raise DataError(
        f"{path}: neither a .npz file, a directory or glob of .npy/.npz shards, TFRecord or "
        "Parquet files, nor an image folder"
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
        for _, _, feats in examples(path):
            for name, f in feats.items():
                d = features.setdefault(name, {"kinds": set(), "records": 0, "counts": set()})
                d["kinds"].add(f.kind)
                d["records"] += 1
                count = len(f.values[0]) if f.kind == "bytes_list" and len(f) == 1 else len(f)
                d["counts"].add(count)
            n += 1
        per_file.append({"file": str(path), "records": n, "gzip": _gzip(path)})
        total += n
    out = {}
    for name, d in sorted(features.items()):
        kinds = sorted(k or "none" for k in d["kinds"])
        unit = "bytes" if kinds == ["bytes_list"] else "values"
        out[name] = {
            "kind": kinds[0] if len(kinds) == 1 else kinds,
            unit: _count(d["counts"]),
            "in_records": d["records"],
        }
    return {
        **_files("tfrecord", files),
        "records": total,
        "per_file": per_file,
        "features": out,
    }


def _parquet(files: list[Path]) -> dict:
    """Each column's type, its values (bytes) per row over every row, its nulls."""
    columns: dict[str, dict] = {}
    per_file, total = [], 0
    for path in files:
        pf = open_file(path)
        for field in pf.schema_arrow:
            columns.setdefault(field.name, {"types": set(), "nulls": 0, "counts": set()})
            columns[field.name]["types"].add(str(field.type))
        for _, batch in batches(path):
            for name, arr in zip(batch.schema.names, batch.columns, strict=True):
                kind, d = kind_of(arr.type), columns[name]
                d["nulls"] += len(nulls(kind, arr))
                if kind is not None and len(arr):
                    n = lengths(kind, arr)
                    d["counts"].update((int(n.min()), int(n.max())))
                    d["unit"] = "bytes" if kind == "binary" else "values"
        rows = pf.metadata.num_rows
        per_file.append({"file": str(path), "rows": rows, "row_groups": pf.num_row_groups})
        total += rows
    out = {}
    for name, d in columns.items():
        types = sorted(d["types"])
        c: dict = {"type": types[0] if len(types) == 1 else types}
        if d["counts"]:
            c[d["unit"]] = _count(d["counts"])
        out[name] = {**c, "nulls": d["nulls"]}
    return {
        **_files("parquet", files),
        "rows": total,
        "per_file": per_file,
        "columns": out,
    }


def _files(fmt: str, files: list[Path]) -> dict:
    return {
        "path": str(files[0].parent) if len(files) > 1 else str(files[0]),
        "format": fmt,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
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


def _count(counts: set[int]) -> int | list[int]:
    """The count every item had, or [fewest, most] when they differ."""
    return min(counts) if len(counts) == 1 else [min(counts), max(counts)]


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
    if d["format"] == "parquet":
        lines = [f"{d['path']}: Parquet, {_n(d['files'], 'file')}, {_n(d['rows'], 'row')}, {size}"]
        for k, c in d["columns"].items():
            many = "not numbers"
            for unit in ("bytes", "values"):
                n = c.get(unit)
                if n is not None:
                    many = f"{n[0]}-{n[1]} {unit}" if isinstance(n, list) else _n(n, unit[:-1])
            null = f", {_n(c['nulls'], 'null')}" if c["nulls"] else ""
            lines.append(f"  {k:<12} {c['type']!s:<24} {many}{null}")
        return "\n".join(lines)
    lines = [f"{d['path']}: TFRecord, {_n(d['files'], 'file')}, {d['records']} records, {size}"]
    for k, f in d["features"].items():
        unit = "bytes" if "bytes" in f else "values"
        n = f[unit]  # a count, or [fewest, most] when records differ
        many = f"{n[0]}-{n[1]} {unit}" if isinstance(n, list) else _n(n, unit[:-1])
        lines.append(f"  {k:<12} {f['kind']!s:<11} {many}, in {_n(f['in_records'], 'record')}")
    return "\n".join(lines)
