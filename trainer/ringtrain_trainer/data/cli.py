"""``ringtrain data inspect PATH`` and ``ringtrain data convert SRC DEST``.

Pipeline position: before training, on the trainer's side of the command table (they read
numpy arrays; the control plane imports neither numpy nor the trainer). ``inspect`` is
:mod:`.describe`; ``convert`` is :mod:`.convert`, its mapping of TFRecord features
(:mod:`.mapping`) or Parquet columns (:mod:`.parquet`) given by the same flags below. Both
end with a refusal naming the file (and the record or row, and the feature or column) when
the data cannot be read as stated, with the exit code of a permanent error (2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ringtrain.errors import RingtrainError, exit_code_for
from ringtrain_trainer.data.convert import SHARD_BYTES, convert_fields, convert_npz
from ringtrain_trainer.data.describe import describe, text
from ringtrain_trainer.data.images import COLORS, convert_images, is_image_folder
from ringtrain_trainer.data.mapping import Field, parse_shape
from ringtrain_trainer.data.parquet import parquet_files
from ringtrain_trainer.data.tfrecord import tfrecord_files


def inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain data inspect",
        description="What a data set holds: its format, files, rows, each array's shape and "
        "dtype (TFRecord: each feature's kind and value count over every record; Parquet: each "
        "column's type and value count over every row), its size.",
    )
    p.add_argument(
        "path",
        metavar="PATH",
        help="a .npz, a directory or glob of shards, of TFRecord or of Parquet files, one TFRecord "
        "or Parquet file, or an image folder",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def inspect_main(argv: list[str]) -> int:
    ns = inspect_parser().parse_args(argv)
    try:
        d = describe(ns.path)
    except RingtrainError as e:
        print(f"ringtrain data inspect: {type(e).__name__}: {e}", file=sys.stderr)
        return exit_code_for(e)
    print(json.dumps(d) if ns.json else text(d))
    return 0


def convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain data convert",
        description="Write a .npz, TFRecord files of tf.train.Example, Parquet files or an image "
        "folder as the .npy shards the trainer streams (spec.trainer.data names DEST).",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="a .npz (x_train, y_train, x_test, y_test), or the training split's TFRecord or "
        "Parquet file, directory or glob, or its image folder (one sub-folder per class)",
    )
    p.add_argument("dest", metavar="DEST", help="a new (or empty) directory for the shards")
    p.add_argument(
        "--test",
        metavar="SRC",
        help="TFRecord, Parquet or image folder: the test split's (required)",
    )
    p.add_argument(
        "--x",
        metavar="FEATURE",
        help="TFRecord/Parquet: the feature or column that is the model's input (required)",
    )
    p.add_argument(
        "--y",
        metavar="FEATURE",
        help="TFRecord/Parquet: the feature or column that is the label (required)",
    )
    p.add_argument(
        "--x-shape",
        metavar="SHAPE",
        help="TFRecord/Parquet: one example's shape, e.g. 28,28 (default: flat)",
    )
    p.add_argument(
        "--x-dtype",
        metavar="DTYPE",
        help="TFRecord/Parquet: the input's stored type (default: uint8 for bytes; TFRecord: "
        "float32, int64; Parquet: the column's)",
    )
    p.add_argument(
        "--y-dtype",
        metavar="DTYPE",
        help="TFRecord/Parquet: the label's stored type (default: int64 or float32; Parquet: "
        "the column's)",
    )
    p.add_argument(
        "--image-size",
        metavar="H,W",
        help="image folder: resize every image to H,W (bilinear; default: all the same size)",
    )
    p.add_argument(
        "--color",
        choices=sorted(COLORS),
        help="image folder: stored as (H, W, 1) or (H, W, 3) uint8 (default: the first image's)",
    )
    p.add_argument(
        "--shard-mb",
        type=float,
        default=SHARD_BYTES / 2**20,
        metavar="MB",
        help="input bytes per shard (default %(default)g MiB)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


class Usage(Exception):
    """Flags that do not fit the input's format: exit 2 with the message."""


#: the flags each input format takes (beyond SRC, DEST, --shard-mb, --json)
FLAGS = {
    "npz": (),
    "tfrecord": ("test", "x", "y", "x_shape", "x_dtype", "y_dtype"),
    "parquet": ("test", "x", "y", "x_shape", "x_dtype", "y_dtype"),
    "image-folder": ("test", "image_size", "color"),
}


NAMES = {
    "npz": ".npz",
    "tfrecord": "TFRecord",
    "parquet": "Parquet",
    "image-folder": "image folder",
}


def _format(src: str) -> str:
    if Path(src).suffix == ".npz" and Path(src).is_file():
        return "npz"
    if is_image_folder(src):
        return "image-folder"
    if tfrecord_files(src) is not None:
        return "tfrecord"
    if parquet_files(src) is not None:
        return "parquet"
    raise Usage(
        f"{src}: neither a .npz file, an image folder (class sub-folders), TFRecord nor Parquet "
        "files"
    )


def _convert(ns, shard_bytes: int):
    fmt = _format(ns.src)
    given = [f for f in sorted(set().union(*FLAGS.values())) if getattr(ns, f)]
    wrong = [f for f in given if f not in FLAGS[fmt]]
    if wrong:
        raise Usage(f"--{wrong[0].replace('_', '-')} is not for {NAMES[fmt]} input ({ns.src})")
    if fmt == "npz":
        return convert_npz(ns.src, ns.dest, shard_bytes)
    need = ("test",) if fmt == "image-folder" else ("test", "x", "y")
    missing = [f"--{f}" for f in need if not getattr(ns, f)]
    if missing:
        raise Usage(
            f"{NAMES[fmt]} input needs {', '.join(missing)} (`ringtrain data inspect` shows "
            "what it holds)"
        )
    try:
        if fmt == "image-folder":
            size = parse_shape(ns.image_size, "--image-size") if ns.image_size else None
            if size is not None and len(size) != 2:
                raise ValueError(f"--image-size {ns.image_size}: give H,W")
            return convert_images(ns.src, ns.test, ns.dest, size, ns.color, shard_bytes)
        shape = parse_shape(ns.x_shape) if ns.x_shape else None
        for flag, dt in (("--x-dtype", ns.x_dtype), ("--y-dtype", ns.y_dtype)):
            if dt is not None and np.dtype(dt).kind not in "uif":
                raise ValueError(f"{flag} {dt}: expected an integer or float type")
    except (ValueError, TypeError) as e:
        raise Usage(str(e)) from None
    x, y = Field("x", ns.x, ns.x_dtype, shape), Field("y", ns.y, ns.y_dtype)
    return convert_fields(fmt, ns.src, ns.test, ns.dest, x, y, shard_bytes)


def convert_main(argv: list[str]) -> int:
    ns = convert_parser().parse_args(argv)
    try:
        s = _convert(ns, max(1, int(ns.shard_mb * 2**20)))
    except Usage as e:
        print(f"ringtrain data convert: {e}", file=sys.stderr)
        return 2
    except RingtrainError as e:
        print(f"ringtrain data convert: {type(e).__name__}: {e}", file=sys.stderr)
        return exit_code_for(e)
    mb_s = s.bytes_read / 1e6 / max(s.seconds, 1e-9)
    if ns.json:
        print(json.dumps({**s.__dict__, "read_mb_per_s": round(mb_s, 1)}))
        return 0
    rows = ", ".join(
        f"{k} {n} rows in {s.shards[k]} shard{'' if s.shards[k] == 1 else 's'}"
        for k, n in s.rows.items()
    )
    print(
        f"ringtrain data convert: wrote {s.dest}: {rows} ({s.bytes_written / 1e6:.1f} MB, "
        f"read {s.bytes_read / 1e6:.1f} MB of {s.format} at {mb_s:.1f} MB/s)"
    )
    for m in s.mapping:
        print(f"  {m}")
    return 0
