"""TFRecord files of ``tf.train.Example`` written by real TensorFlow, read without it (decision
0215): checksums verified, features decoded as TensorFlow parses them, converted once to the
``.npy`` shards the trainer streams, and trained to the same weights as the same samples in a
``.npz``. TensorFlow is used here only to write the files and to say what they hold."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from support.converting import (
    assert_converted_trains_as_the_npz,
    digit_samples,
    run_cli,
    run_measured,
    train_both,
)

from ringtrain.errors import DataError
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.convert import convert_npz, convert_tfrecord
from ringtrain_trainer.data.crc32c import PIECE, crc32c, crc32c_many
from ringtrain_trainer.data.describe import describe
from ringtrain_trainer.data.example import decode
from ringtrain_trainer.data.images import convert_images
from ringtrain_trainer.data.mapping import Field
from ringtrain_trainer.data.tfrecord import blocks, records

#: uneven TFRecord files over 480 training examples
CUTS = (0, 100, 350, 480)


def feature(kind: str, values) -> tf.train.Feature:
    lists = {"bytes": tf.train.BytesList, "float": tf.train.FloatList, "int64": tf.train.Int64List}
    return tf.train.Feature(**{f"{kind}_list": lists[kind](value=values)})


def example(**features: tf.train.Feature) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def write(path, rows, options=None) -> None:
    with tf.io.TFRecordWriter(str(path), options) as w:
        for r in rows:
            w.write(r)


def digit(x8: np.ndarray, xf: np.ndarray, y: int) -> bytes:
    return example(
        image=feature("bytes", [x8.tobytes()]),
        pixels=feature("float", xf.reshape(-1).tolist()),
        label=feature("int64", [int(y)]),
        source=feature("bytes", [b"mnist-5k"]),
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """480 + 200 real digits as TFRecord (train in 3 uneven files, test in one, GZIP) and the
    same samples as one ``.npz`` of float32 ``x / 255``."""
    s = digit_samples()
    x8, xt8, x, xt, y, yt = (s[k] for k in ("x8", "xt8", "x", "xt", "y", "yt"))
    d = tmp_path_factory.mktemp("tfrecord")
    (d / "train").mkdir()
    for i in range(len(CUTS) - 1):
        rows = range(CUTS[i], CUTS[i + 1])
        write(d / "train" / f"digits-{i:02d}.tfrecord", [digit(x8[j], x[j], y[j]) for j in rows])
    write(d / "test.tfrecord.gz", [digit(xt8[j], xt[j], yt[j]) for j in range(200)], "GZIP")
    np.savez(d / "whole.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    return {"d": d, "train": d / "train", "test": d / "test.tfrecord.gz", "x8": x8, "x": x, "y": y}


def test_crc32c_is_the_standard_one_across_piece_boundaries():
    def bitwise(data: bytes) -> int:
        crc = 0xFFFFFFFF
        for b in data:
            crc ^= b
            for _ in range(8):
                crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        return crc ^ 0xFFFFFFFF

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0
    buf = np.random.default_rng(0).integers(0, 256, 3 * PIECE + 50, dtype=np.uint8)
    lens = [0, 1, 7, 8, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 3, 3 * PIECE + 50]
    starts = [0, 5, 3, 11, 1, 0, 2, 7, 0]
    got = crc32c_many(buf, starts, lens)
    assert [int(g) for g in got] == [
        bitwise(bytes(buf[s : s + n])) for s, n in zip(starts, lens, strict=True)
    ]


def test_inspect_reports_what_tensorflow_wrote(digits):
    d = describe(digits["train"])
    assert (d["format"], d["files"], d["records"]) == ("tfrecord", 3, 480)
    assert [f["records"] for f in d["per_file"]] == [100, 250, 130]
    assert d["features"] == {
        "image": {"kind": "bytes_list", "bytes": 784, "in_records": 480},
        "label": {"kind": "int64_list", "values": 1, "in_records": 480},
        "pixels": {"kind": "float_list", "values": 784, "in_records": 480},
        "source": {"kind": "bytes_list", "bytes": 8, "in_records": 480},
    }
    code, out, _ = run_cli("data", "inspect", str(digits["test"]), "--json")
    t = json.loads(out)
    assert code == 0 and t["records"] == 200 and t["per_file"][0]["gzip"] is True
    code, out, _ = run_cli("data", "inspect", str(digits["train"]))
    assert code == 0 and "TFRecord, 3 files, 480 records" in out
    assert "pixels       float_list  784 values, in 480 records" in out


def test_convert_gives_what_tensorflows_own_parsing_yields(digits, tmp_path):
    dest = tmp_path / "shards"
    code, out, err = run_cli(
        "data", "convert", str(digits["train"]), str(dest), "--test", str(digits["test"]),
        "--x", "image", "--x-shape", "28,28", "--y", "label", "--shard-mb", "0.1",
    )  # fmt: skip
    assert code == 0, err
    assert "image (bytes_list) -> uint8 28x28" in out and "train 480 rows in 4 shards" in out
    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    files = sorted(str(p) for p in digits["train"].iterdir())
    want_x, want_y = [], []
    for r in tf.data.TFRecordDataset(files):
        ex = tf.io.parse_single_example(r, spec)
        want_x.append(tf.reshape(tf.io.decode_raw(ex["image"], tf.uint8), [28, 28]).numpy())
        want_y.append(ex["label"].numpy())
    ds = data_mod.load("fashion-mnist", dest)
    x = np.asarray(ds.train.images)
    assert x.dtype == np.uint8 and x.shape == (480, 28, 28)
    np.testing.assert_array_equal(x, np.stack(want_x))
    np.testing.assert_array_equal(ds.train.labels, np.array(want_y))
    np.testing.assert_array_equal(x, digits["x8"])
    # the float feature, as FixedLenFeature([28, 28], tf.float32) parses it
    fdest = tmp_path / "floats"
    convert_tfrecord(
        digits["train"],
        digits["test"],
        fdest,
        Field("x", "pixels", None, (28, 28)),
        Field("y", "label"),
    )
    fspec = {"pixels": tf.io.FixedLenFeature([28, 28], tf.float32)}
    got = np.asarray(data_mod.load("fashion-mnist", fdest).train.images)
    want = np.stack(
        [
            tf.io.parse_single_example(r, fspec)["pixels"].numpy()
            for r in tf.data.TFRecordDataset(files)
        ]
    )
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_packed_and_unpacked_lists_decode_as_tensorflow_parses_them():
    """TensorFlow writes packed lists; other writers may put one field per value. Both decode
    as ``parse_single_example`` parses them; a packed list split over two occurrences decodes
    as protobuf's own parser reads it (TensorFlow's fast parser refuses that one)."""

    def ld(field: int, payload: bytes) -> bytes:
        return bytes([field << 3 | 2, len(payload)]) + payload

    def varint(v: int) -> bytes:
        v &= (1 << 64) - 1
        out = b""
        while v >= 0x80:
            out, v = out + bytes([v & 0x7F | 0x80]), v >> 7
        return out + bytes([v])

    floats = [0.5, -2.25, 3.0]
    ints = [-1, 0, 300, 2**40]
    unpacked_f = b"".join(b"\x0d" + np.float32(v).tobytes() for v in floats)
    unpacked_i = b"".join(b"\x08" + varint(v) for v in ints)
    packed_i_head = ld(1, b"".join(varint(v) for v in ints[:2]))
    packed_i_tail = ld(1, b"".join(varint(v) for v in ints[2:]))

    def entry(name: str, kind: int, lst: bytes) -> bytes:
        return ld(1, ld(1, name.encode()) + ld(2, ld(kind, lst)))

    raw = ld(1, entry("f", 2, unpacked_f) + entry("i", 3, unpacked_i))
    packed = example(f=feature("float", floats), i=feature("int64", ints))
    spec = {"f": tf.io.FixedLenFeature([3], tf.float32), "i": tf.io.FixedLenFeature([4], tf.int64)}
    for record in (raw, packed):
        got = decode(record)
        parsed = tf.io.parse_single_example(record, spec)
        np.testing.assert_array_equal(got["f"].values, parsed["f"].numpy())
        np.testing.assert_array_equal(got["i"].values, parsed["i"].numpy())
        assert got["i"].values.tolist() == ints
    split = ld(1, entry("f", 2, unpacked_f) + entry("i", 3, packed_i_head + packed_i_tail))
    proto = tf.train.Example.FromString(split).features.feature
    assert decode(split)["i"].values.tolist() == list(proto["i"].int64_list.value) == ints
    assert decode(split)["f"].values.tolist() == list(proto["f"].float_list.value) == floats


def flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_corrupted_byte_is_refused_naming_the_file_and_the_record(digits, tmp_path):
    src = digits["train"] / "digits-01.tfrecord"
    sizes = [12 + len(r) + 4 for _, r in records(src)]
    starts = np.cumsum([0, *sizes])
    cases = {
        "data": (starts[57] + 12 + 300, "record 57: its data's checksum does not match"),
        "length": (starts[131] + 2, "record 131: its length's checksum does not match"),
    }
    for name, (at, message) in cases.items():
        bad = tmp_path / name / "digits.tfrecord"
        bad.parent.mkdir()
        shutil.copy(src, bad)
        flip(bad, int(at))
        with pytest.raises(tf.errors.DataLossError):  # TensorFlow agrees the file is corrupt
            list(tf.data.TFRecordDataset([str(bad)]))
        with pytest.raises(DataError, match=re.escape(f"{bad}: {message}")):
            describe(bad)
        code, _, err = run_cli(
            "data", "convert", str(bad.parent), str(tmp_path / f"out-{name}"),
            "--test", str(digits["test"]), "--x", "image", "--y", "label",
        )  # fmt: skip
        assert code == 2 and f"{bad}: {message}" in err
        assert not (tmp_path / f"out-{name}").exists()  # whole or nothing
        assert not any(p.name.startswith(f"out-{name}.partial") for p in tmp_path.iterdir())
    cut = tmp_path / "cut.tfrecord"
    cut.write_bytes(src.read_bytes()[: starts[249] + 100])
    with pytest.raises(DataError, match=re.escape(f"{cut}: record 249: truncated")):
        describe(cut)


def test_the_mapping_is_checked_naming_the_file_record_and_feature(tmp_path):
    good = example(
        image=feature("bytes", [bytes(4)]), n=feature("int64", [1, 2]), label=feature("int64", [3])
    )
    wrong = {
        "no feature 'label' (it has: image, n)": example(
            image=feature("bytes", [bytes(4)]), n=feature("int64", [1, 2])
        ),
        "feature 'image' holds 3 bytes; expected 4": example(
            image=feature("bytes", [bytes(3)]), label=feature("int64", [3])
        ),
        "feature 'image' is a float_list, but the first record's is a bytes_list": example(
            image=feature("float", [1.0] * 4), label=feature("int64", [3])
        ),
        "feature 'image' holds 2 byte strings": example(
            image=feature("bytes", [b"ab", b"cd"]), label=feature("int64", [1])
        ),
        "feature 'label' holds 2 values; expected 1": example(
            image=feature("bytes", [bytes(4)]), label=feature("int64", [1, 2])
        ),
    }
    for k, (message, record) in enumerate(wrong.items()):
        path = tmp_path / f"t{k}.tfrecord"
        write(path, [good, good, record])
        with pytest.raises(DataError, match=re.escape(f"{path}: record 2: {message}")):
            convert_tfrecord(
                path, path, tmp_path / f"o{k}", Field("x", "image"), Field("y", "label")
            )
    path = tmp_path / "ids.tfrecord"
    write(
        path,
        [
            good,
            example(
                image=feature("bytes", [bytes(4)]),
                n=feature("int64", [1, 300]),
                label=feature("int64", [3]),
            ),
        ],
    )
    with pytest.raises(
        DataError, match=re.escape(f"{path}: record 1: feature 'n' holds 300, which uint8")
    ):
        convert_tfrecord(
            path, path, tmp_path / "ids", Field("x", "n", "uint8"), Field("y", "label")
        )
    floats = tmp_path / "floats.tfrecord"
    write(floats, [example(v=feature("float", [0.5]), label=feature("int64", [1]))])
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{floats}: record 0: feature 'v' is a float_list; --x-dtype uint8 would round"
        ),
    ):
        convert_tfrecord(
            floats, floats, tmp_path / "fl", Field("x", "v", "uint8"), Field("y", "label")
        )
    code, _, err = run_cli("data", "convert", str(path), str(tmp_path / "o"), "--x", "image")
    assert code == 2 and "TFRecord input needs --test, --y" in err


def test_training_from_converted_tfrecord_equals_training_from_the_npz(digits, tmp_path):
    assert_converted_trains_as_the_npz("tfrecord", digits, tmp_path / "shards", digits["train"])


def test_convert_npz_streams_plain_and_compressed_members_into_shards(digits, tmp_path):
    whole = np.load(digits["d"] / "whole.npz")
    arrays = {k: whole[k] for k in whole.files}
    np.savez_compressed(tmp_path / "z.npz", **arrays)
    for src in (digits["d"] / "whole.npz", tmp_path / "z.npz"):
        dest = tmp_path / f"from-{src.stem}"
        code, out, err = run_cli("data", "convert", str(src), str(dest), "--shard-mb", "0.5")
        assert code == 0, err
        assert "train 480 rows in 3 shards, test 200 rows in 2 shards" in out
        ds = data_mod.load("fashion-mnist", dest)
        np.testing.assert_array_equal(np.asarray(ds.train.images), arrays["x_train"])
        np.testing.assert_array_equal(ds.test.labels, arrays["y_test"])
    code, _, err = run_cli("data", "convert", str(src), str(tmp_path / "from-z"))
    assert code == 2 and "exists and is not an empty directory" in err
    np.savez(tmp_path / "multi.npz", **arrays, x2_train=arrays["x_train"])
    with pytest.raises(DataError, match="holds 'x2_train'; shards hold x_train"):
        convert_npz(tmp_path / "multi.npz", tmp_path / "m")
    d = describe(tmp_path / "z.npz")
    assert d["arrays"]["x_train"] == {
        "shape": [480, 28, 28],
        "dtype": "float32",
        "bytes": 480 * 784 * 4 + 128,
        "compressed": True,
    }
    assert describe(tmp_path / "from-z")["splits"]["train"]["shards"] == 3
    assert os.path.exists(tmp_path / "from-z" / "x_train-00002.npy")


def test_records_across_block_boundaries_and_longer_than_a_block(tmp_path):
    """The framing is walked a block at a time: a record cut by a block's end is carried to
    the next, one longer than a block gets a block of its own; the records are the same."""
    rng = np.random.default_rng(1)
    sizes = [0, 1, 7, 300, 5000, 12, 70_000, 3, 2049, 16]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    path = tmp_path / "mixed.tfrecord"
    write(path, payloads)
    for block in (13, 64, 1000, 4096, 1 << 20):
        got = [
            (b.first + i, bytes(b.record(i))) for b in blocks(path, block) for i in range(len(b))
        ]
        assert got == list(enumerate(payloads)), block


def test_convert_holds_one_shard_in_memory_whatever_the_data_size(tmp_path):
    """Converting 256 MiB of records (256 x 1 MiB, written by TensorFlow) into 4 MiB shards
    peaks far below the data's size: the worker-side bound of decision 0209, kept while
    converting."""
    path = tmp_path / "big.tfrecord"
    rng = np.random.default_rng(2)
    chunk = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with tf.io.TFRecordWriter(str(path)) as w:
        for i in range(256):
            w.write(
                example(x=feature("bytes", [chunk[i:] + chunk[:i]]), y=feature("int64", [i % 10]))
            )
    assert path.stat().st_size > 256 << 20
    out, peak_mib = run_measured(
        "data", "convert", str(path), str(tmp_path / "out"), "--test", str(path),
        "--x", "x", "--y", "y", "--shard-mb", "4",
    )  # fmt: skip
    assert "train 256 rows in 64 shards" in out
    assert peak_mib < 128, peak_mib  # measured 87-91 MiB: a block, a shard, the interpreter


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The digits as PNG files in one folder per class (Keras' layout), train and test, and the
    same pixels as a ``.npz`` in the order the folders list them (class, then file name)."""
    from PIL import Image

    m = data_mod.load_mnist5k()
    rng = np.random.default_rng(9)
    d = tmp_path_factory.mktemp("images")
    arrays = {}
    for split, part, n in (("train", m.train, 240), ("test", m.test, 100)):
        pick = rng.permutation(len(part))[:n]
        x, y = part.images[pick], part.labels[pick]
        for i, (img, label) in enumerate(zip(x, y, strict=True)):
            (d / split / f"digit-{label}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(d / split / f"digit-{label}" / f"{i:04d}.png")
        order = np.lexsort((np.arange(n), y))  # by class, then by file name
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x[order][..., None], y[order]
    np.savez(d / "same.npz", **arrays)
    return {"d": d, **arrays}


def test_an_image_folder_converts_as_keras_reads_it_and_trains_as_the_npz(folders, tmp_path):
    import keras

    d = folders["d"]
    code, out, err = run_cli(
        "data", "convert", str(d / "train"), str(tmp_path / "s"), "--test", str(d / "test")
    )
    assert code == 0, err
    assert "classes: digit-0, digit-1" in out and "x: uint8 (28, 28, 1) (L)" in out
    code, out, _ = run_cli("data", "inspect", str(d / "train"), "--json")
    seen = json.loads(out)
    assert (seen["format"], seen["files"], seen["sizes_hxw"], seen["modes"]) == (
        "image-folder",
        240,
        {"28x28": 240},
        {"L": 240},
    )
    assert list(seen["classes"]) == [f"digit-{c}" for c in range(10)]
    assert sum(seen["classes"].values()) == 240
    ds = data_mod.load("fashion-mnist", tmp_path / "s")
    got = np.asarray(ds.train.images)
    np.testing.assert_array_equal(got, folders["x_train"])
    np.testing.assert_array_equal(ds.test.labels, folders["y_test"])
    kds = keras.utils.image_dataset_from_directory(
        d / "train", color_mode="grayscale", image_size=(28, 28), shuffle=False, batch_size=None
    )
    kx, ky = zip(*[(a.numpy(), b.numpy()) for a, b in kds], strict=True)
    np.testing.assert_array_equal(got.astype(np.float32), np.stack(kx))
    np.testing.assert_array_equal(ds.train.labels, np.array(ky))

    shards, memory = train_both(tmp_path / "s", d / "same.npz", lr=1e-4)
    np.testing.assert_array_equal(shards.params, memory.params)
    assert shards.test_accuracy == memory.test_accuracy


def test_what_an_image_folder_cannot_be_is_refused_naming_the_file(folders, tmp_path):
    from PIL import Image

    bad = tmp_path / "bad"
    shutil.copytree(folders["d"] / "train", bad)
    (bad / "digit-3" / "9999.png").write_bytes(b"not a png")
    with pytest.raises(
        DataError, match=re.escape(f"{bad / 'digit-3' / '9999.png'}: not an image Pillow")
    ):
        convert_images(bad, folders["d"] / "test", tmp_path / "o1")
    (bad / "digit-3" / "9999.png").unlink()
    Image.new("L", (30, 28)).save(bad / "digit-4" / "9999.png")
    with pytest.raises(
        DataError, match=re.escape(f"{bad / 'digit-4' / '9999.png'}: 30x28 pixels, but")
    ):
        convert_images(bad, folders["d"] / "test", tmp_path / "o2")
    s = convert_images(bad, folders["d"] / "test", tmp_path / "o3", size=(28, 28))  # resized
    assert s.rows["train"] == 241
    (bad / "digit-4" / "9999.png").unlink()
    other = tmp_path / "test"
    shutil.copytree(folders["d"] / "test", other)
    (other / "digit-3").rename(other / "three")
    with pytest.raises(DataError, match="class 'three' is not one of the training folder's"):
        convert_images(bad, other, tmp_path / "o4")
    code, _, err = run_cli(
        "data", "convert", str(bad), str(tmp_path / "o5"), "--test", str(other), "--x", "image"
    )
    assert code == 2 and "--x is not for image folder input" in err
    with pytest.raises(
        DataError, match=re.escape(f"{folders['d'] / 'test'}: holds folders, not images")
    ):
        convert_images(folders["d"], folders["d"] / "test", tmp_path / "o6")  # the splits' parent
    with pytest.raises(DataError, match=r"image folders are trained from as \.npy shards: convert"):
        data_mod.load("fashion-mnist", folders["d"] / "train")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["bad", "o3", "test"]  # the refused conversions left nothing, not even .partial
