import gzip
import struct

import numpy as np
import pytest

from ringtrain.errors import DataError, InvalidSpec
from ringtrain_trainer.data import dataset as D


def idx_bytes(arr: np.ndarray, type_code: int = 0x08) -> bytes:
    head = bytes([0, 0, type_code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return head + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def test_idx_reader_reads_raw_and_gzip(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "raw").write_bytes(idx_bytes(a))
    (tmp_path / "z.gz").write_bytes(gzip.compress(idx_bytes(a)))
    np.testing.assert_array_equal(D.read_idx(tmp_path / "raw"), a)
    np.testing.assert_array_equal(D.read_idx(tmp_path / "z.gz"), a)
    b = np.array([1, -2, 300], np.int32)
    (tmp_path / "i").write_bytes(idx_bytes(b, 0x0C))
    np.testing.assert_array_equal(D.read_idx(tmp_path / "i"), b)


@pytest.mark.parametrize(
    "mangle, problem",
    [
        (lambda b: b"\x01" + b[1:], "bad magic"),
        (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX element type"),
        (lambda b: b[:-1], "need 24 data bytes but the file has 23"),
        (lambda b: b + b"\x00", "but the file has 25"),
        (lambda b: b[:6], "ends first"),
        (lambda b: b[:3], "too short"),
        (lambda b: b[:3] + b"\x00" + b[4:], "0 dimensions"),
    ],
)
def test_idx_reader_names_file_and_problem(tmp_path, mangle, problem):
    a = np.zeros((2, 3, 4), np.uint8)
    p = tmp_path / "broken-idx3-ubyte"
    p.write_bytes(mangle(idx_bytes(a)))
    with pytest.raises(DataError, match=problem) as e:
        D.read_idx(p)
    assert str(p) in str(e.value)


def test_idx_reader_truncated_gzip_and_missing_file(tmp_path):
    a = np.zeros((50, 28, 28), np.uint8)
    p = tmp_path / "t.gz"
    p.write_bytes(gzip.compress(idx_bytes(a))[:-20])
    with pytest.raises(DataError, match="cannot read") as e:
        D.read_idx(p)
    assert str(p) in str(e.value)
    with pytest.raises(DataError, match="no such IDX file"):
        D.read_idx(tmp_path / "nope")


def test_idx_dir_checks_images_against_labels(tmp_path):
    imgs = np.zeros((5, 28, 28), np.uint8)
    for prefix in ("train", "t10k"):
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(imgs))
        (tmp_path / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(idx_bytes(np.zeros(4, np.uint8)))
        )
    with pytest.raises(DataError, match=r"5 images but .*has 4 labels"):
        D.load_idx_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DataError, match=r"neither t10k-images-idx3-ubyte nor .*\.gz exists"):
        D.load_idx_dir(tmp_path)
    with pytest.raises(DataError, match="data directory does not exist"):
        D.load_idx_dir(tmp_path / "missing")


def test_fashion_mnist_from_debian_package():
    ds = D.load("fashion-mnist")
    assert ds.train.images.shape == (60000, 28, 28) and ds.test.images.shape == (10000, 28, 28)
    assert np.bincount(ds.train.labels).tolist() == [6000] * 10


def test_mnist5k_split_is_balanced_and_disjoint(mnist5k):
    assert len(mnist5k.train) == 4000 and len(mnist5k.test) == 1000
    assert np.bincount(mnist5k.test.labels).tolist() == [100] * 10
    flat = lambda s: {bytes(r) for r in s.images.reshape(len(s), -1)}  # noqa: E731
    assert not flat(mnist5k.train) & flat(mnist5k.test)


def tf_shard(stream: np.ndarray, n: int, i: int) -> np.ndarray:
    """tf.data Dataset.shard(n, i): keep elements whose position j satisfies j % n == i."""
    return np.array([e for j, e in enumerate(stream) if j % n == i])


@pytest.mark.parametrize("n, b, m", [(1, 8, 100), (2, 8, 100), (3, 5, 101), (4, 7, 97)])
def test_sharding_is_tf_shard_of_the_shuffled_stream(n, b, m):
    sharders = [D.Sharder(m, b, n, i, seed=7) for i in range(n)]
    single = D.Sharder(m, n * b, 1, 0, seed=7)
    assert {s.steps_per_epoch for s in sharders} == {m // (n * b)} == {single.steps_per_epoch}
    for epoch in (0, 1):
        stream = sharders[0].order(epoch)
        for i, s in enumerate(sharders):
            shard = tf_shard(stream, n, i)
            got = np.concatenate([s.indices(epoch, k) for k in range(s.steps_per_epoch)])
            np.testing.assert_array_equal(got, shard[: len(got)])
        for k in range(single.steps_per_epoch):
            concat = np.concatenate([s.indices(epoch, k) for s in sharders])
            np.testing.assert_array_equal(concat, sharders[0].global_batch_indices(epoch, k))
            np.testing.assert_array_equal(np.sort(concat), np.sort(single.indices(epoch, k)))


def test_shuffle_is_deterministic_per_seed_and_epoch():
    a, b = D.Sharder(1000, 10, seed=1), D.Sharder(1000, 10, seed=1)
    np.testing.assert_array_equal(a.order(3), b.order(3))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), D.Sharder(1000, 10, seed=2).order(0))
    assert sorted(a.order(5).tolist()) == list(range(1000))


def test_sharder_rejects_impossible_batches():
    with pytest.raises(InvalidSpec, match="fewer than one global batch"):
        D.Sharder(10, 4, world=3, rank=0)
    with pytest.raises(InvalidSpec, match="rank 3"):
        D.Sharder(10, 1, world=3, rank=3)


def test_position_counts_steps_and_rescales_across_world_sizes():
    s = D.Sharder(100, 10, world=2, rank=0)
    pos = D.Position(0, 0, 20)
    for _ in range(7):
        pos = s.advance(pos)
    assert pos == D.Position(1, 2, 20)
    assert D.Position(1, 2, 20).rescale(10) == D.Position(1, 4, 10)
    assert D.Position(1, 3, 10).rescale(20) == D.Position(1, 1, 20)


def test_batch_into_scales_pixels_without_allocating(mnist5k):
    idx = np.array([3, 1, 4])
    x = np.zeros((3, 28, 28, 1), np.float32)
    y = np.zeros(3, np.int64)
    D.batch_into(mnist5k.train, idx, x, y, np.zeros((3, 28, 28), np.uint8))
    np.testing.assert_allclose(x[..., 0], mnist5k.train.images[idx] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, mnist5k.train.labels[idx])
