"""Image folders (one sub-folder per class) decoded once into the ``.npy`` shards the trainer
streams: ``ringtrain data convert images/train DEST --test images/test``.

Pipeline position: beside :func:`.convert.convert_tfrecord`, writing through the same
:class:`~.convert.ShardWriter` (one shard's rows in memory, the output whole or not at all).

The layout and labels are Keras' ``image_dataset_from_directory(labels="inferred")``: the
class names are the training folder's sub-folders sorted, a class's label its index, the
files those ending in ``.bmp .gif .jpeg .jpg .png`` (any case), sorted per class. The test
folder's classes are labelled by the *training* folder's list, so a test folder lacking a class
does not shift the labels; a class the training folder lacks is refused. Pixels are stored as
uint8 ``(H, W, C)``: C = 1 for ``--color grayscale`` (Pillow mode ``L``), 3 for ``rgb``; the
default is the first image's (grayscale if its mode is ``L`` or ``1``, else rgb). Without
``--image-size H,W`` every image must have the first one's size (refused naming the file);
with it, each is resized with Pillow's bilinear filter (Keras resizes with TensorFlow's, whose
values differ slightly: resize beforehand when they must match exactly).

Pillow decodes; it is not in the runtime install (``requirements/runtime.txt``), so the
command asks for it by name when it is missing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError
from ringtrain_trainer.data.convert import SHARD_BYTES, ShardWriter, Summary, finish, staged

#: Keras' ALLOWLIST_FORMATS for image_dataset_from_directory
EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
COLORS = {"grayscale": "L", "rgb": "RGB"}


def is_image_folder(path: str | os.PathLike) -> bool:
    """A directory holding sub-directories and no files of its own (hidden entries aside)."""
    p = Path(path)
    if not p.is_dir():
        return False
    entries = [e for e in p.iterdir() if not e.name.startswith(".")]
    return bool(entries) and all(e.is_dir() for e in entries)


def index(root: Path, classes: list[str] | None = None) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(file, label)]) of an image folder; ``classes``: the training folder's."""
    own = sorted(e.name for e in root.iterdir() if e.is_dir() and not e.name.startswith("."))
    names = own if classes is None else classes
    unknown = sorted(set(own) - set(names))
    if unknown:
        raise DataError(
            f"{root / unknown[0]}: class {unknown[0]!r} is not one of the training folder's "
            f"({', '.join(names)})"
        )
    files = []
    for name in own:
        entries = sorted((root / name).iterdir())
        mine = [f for f in entries if f.is_file() and f.suffix.lower() in EXTENSIONS]
        if not mine and any(e.is_dir() for e in entries):  # images/ of images/{train,test}/
            raise DataError(
                f"{root / name}: holds folders, not images: give each split's folder (such as "
                f"this one) as SRC or --test, not {root}"
            )
        files += [(f, names.index(name)) for f in mine]
    if not files:
        raise DataError(f"{root}: no {'/'.join(EXTENSIONS)} file in its class folders")
    return names, files


def pil():
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError(
            "image folders are decoded with Pillow, which is not installed (pip install pillow)"
        ) from None
    return Image, UnidentifiedImageError


def _decode(path: Path, mode: str | None, size: tuple[int, int] | None):
    Image, Unidentified = pil()
    try:
        with Image.open(path) as im:
            im.load()
            if mode is None:
                mode = "L" if im.mode in ("L", "1") else "RGB"
            im = im.convert(mode)
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            a = np.asarray(im, np.uint8)
    except (Unidentified, OSError) as e:
        raise DataError(f"{path}: not an image Pillow can read ({e})") from None
    return (a[..., None] if a.ndim == 2 else a), mode


def convert_images(
    train: str | os.PathLike,
    test: str | os.PathLike,
    dest: str | os.PathLike,
    size: tuple[int, int] | None = None,
    color: str | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Summary:
    """The images of ``train`` and ``test`` (folders of class folders) as shards of ``dest``."""
    dest, t0 = Path(dest), time.perf_counter()
    s = Summary(f"{train} + {test}", "image-folder", str(dest))
    mode = COLORS[color] if color else None
    with staged(dest) as tmp:
        classes, _ = index(Path(train))
        writers: dict[str, ShardWriter] = {}
        first: tuple[Path, tuple[int, ...]] | None = None
        for split, root in (("train", Path(train)), ("test", Path(test))):
            _, files = index(root, classes)
            for path, label in files:
                s.bytes_read += path.stat().st_size
                a, mode = _decode(path, mode, size)
                if first is None:
                    first = (path, a.shape)
                    s.mapping = [f"classes: {', '.join(classes)}", f"x: uint8 {a.shape} ({mode})"]
                elif a.shape != first[1]:
                    raise DataError(
                        f"{path}: {a.shape[1]}x{a.shape[0]} pixels, but {first[0]} is "
                        f"{first[1][1]}x{first[1][0]}; give --image-size H,W to resize every image"
                    )
                if split not in writers:
                    writers[split] = ShardWriter(
                        tmp, split, (a.shape, np.uint8), ((), np.int64), shard_bytes
                    )
                xo, yo = writers[split].row()
                xo[0], yo[0] = a, label
        return finish(tmp, dest, writers, s, t0)
