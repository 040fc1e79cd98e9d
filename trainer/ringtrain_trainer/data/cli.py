"""``ringtrain data inspect PATH`` and ``ringtrain data convert SRC DEST``.

Pipeline position: before training, on the trainer's side of the command table (they read
numpy arrays; the control plane imports neither numpy nor the trainer). ``inspect`` is
:mod:`.describe`; ``convert`` is :mod:`.convert`, its mapping of TFRecord features
(:mod:`.mapping`) given by the flags below. Both end with a refusal naming the file (and the
record and feature) when the data cannot be read as stated, with the exit code of a
permanent error (2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ringtrain.errors import RingtrainError, exit_code_for
from ringtrain_trainer.data.convert import SHARD_BYTES, convert_npz, convert_tfrecord
from ringtrain_trainer.data.describe import describe, text
from ringtrain_trainer.data.mapping import Field, parse_shape
from ringtrain_trainer.data.tfrecord import tfrecord_files


def inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain data inspect",
        description="What a data set holds: its format, files, rows, each array's shape and "
        "dtype (TFRecord: each feature's kind and value count over every record), its size.",
    )
    p.add_argument(
        "path",
        metavar="PATH",
        help="a .npz, a directory or glob of shards or of TFRecord files, or one TFRecord file",
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
        description="Write a .npz, or TFRecord files of tf.train.Example, as the .npy shards "
        "the trainer streams (spec.trainer.data names DEST).",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="a .npz (x_train, y_train, x_test, y_test), or "
        "the training split's TFRecord file, directory or glob",
    )
    p.add_argument("dest", metavar="DEST", help="a new (or empty) directory for the shards")
    p.add_argument(
        "--test",
        metavar="SRC",
        help="TFRecord: the test split's file, directory or glob (required)",
    )
    p.add_argument(
        "--x", metavar="FEATURE", help="TFRecord: the feature that is the model's input (required)"
    )
    p.add_argument(
        "--y", metavar="FEATURE", help="TFRecord: the feature that is the label (required)"
    )
    p.add_argument(
        "--x-shape",
        metavar="SHAPE",
        help="TFRecord: one example's shape, e.g. 28,28 (default: flat)",
    )
    p.add_argument(
        "--x-dtype",
        metavar="DTYPE",
        help="TFRecord: the input's stored type (default: uint8 for bytes, float32, int64)",
    )
    p.add_argument(
        "--y-dtype",
        metavar="DTYPE",
        help="TFRecord: the label's stored type (default: int64 or float32)",
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


def convert_main(argv: list[str]) -> int:
    ns = convert_parser().parse_args(argv)
    shard_bytes = max(1, int(ns.shard_mb * 2**20))
    tf_flags = [f for f in ("test", "x", "y", "x_shape", "x_dtype", "y_dtype") if getattr(ns, f)]
    try:
        if Path(ns.src).suffix == ".npz" and Path(ns.src).is_file():
            if tf_flags:
                flag = "--" + tf_flags[0].replace("_", "-")
                print(
                    f"ringtrain data convert: {flag} is for TFRecord input; {ns.src} is a "
                    ".npz holding both splits",
                    file=sys.stderr,
                )
                return 2
            s = convert_npz(ns.src, ns.dest, shard_bytes)
        elif tfrecord_files(ns.src) is not None:
            missing = [f"--{f}" for f in ("test", "x", "y") if not getattr(ns, f)]
            if missing:
                print(
                    f"ringtrain data convert: TFRecord input needs {', '.join(missing)} "
                    f"(`ringtrain data inspect {ns.src}` lists the features)",
                    file=sys.stderr,
                )
                return 2
            try:
                shape = parse_shape(ns.x_shape) if ns.x_shape else None
                for flag, dt in (("--x-dtype", ns.x_dtype), ("--y-dtype", ns.y_dtype)):
                    if dt is not None and np.dtype(dt).kind not in "uif":
                        raise ValueError(f"{flag} {dt}: expected an integer or float type")
            except (ValueError, TypeError) as e:
                print(f"ringtrain data convert: {e}", file=sys.stderr)
                return 2
            s = convert_tfrecord(
                ns.src,
                ns.test,
                ns.dest,
                Field("x", ns.x, ns.x_dtype, shape),
                Field("y", ns.y, ns.y_dtype),
                shard_bytes,
            )
        else:
            print(
                f"ringtrain data convert: {ns.src}: neither a .npz file nor TFRecord files",
                file=sys.stderr,
            )
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
