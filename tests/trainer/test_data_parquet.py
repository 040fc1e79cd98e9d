"""Parquet files written by real pyarrow (decision 0216): inspected as written, converted once
to the ``.npy`` shards the trainer streams — equal to what pyarrow itself reads back — refused
naming the file, the row and the column when they cannot be mapped, and trained to the same
weights as the same samples in a ``.npz``."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.converting import (
    assert_converted_trains_as_the_npz,
    digit_samples,
    run_cli,
    run_measured,
)

from ringtrain.errors import DataError
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.convert import convert_parquet
from ringtrain_trainer.data.describe import describe
from ringtrain_trainer.data.mapping import Field

#: uneven Parquet files over 480 training examples, each in row groups of ROW_GROUP rows
CUTS = (0, 100, 350, 480)
ROW_GROUP = 64


def table(x8: np.ndarray, x: np.ndarray, y: np.ndarray) -> pa.Table:
    """The digits as a data team would write them: the image as a flat list of uint8, as raw
    bytes and as a fixed-size list of float32 ``x / 255``, the label an int64 column."""
    n = len(x8)
    return pa.table(
        {
            "image": pa.array(list(x8.reshape(n, -1)), pa.list_(pa.uint8())),
            "raw": pa.array([r.tobytes() for r in x8]),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 784),
            "label": pa.array(y, pa.int64()),
            "source": pa.array(["mnist-5k"] * n),
        }
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """480 + 200 real digits as Parquet (train in 3 uneven files of 64-row row groups, test in
    one file of one row group) and the same samples as one ``.npz`` of float32 ``x / 255``."""
    s = digit_samples()
    x8, xt8, x, xt, y, yt = (s[k] for k in ("x8", "xt8", "x", "xt", "y", "yt"))
    d = tmp_path_factory.mktemp("parquet")
    (d / "train").mkdir()
    for i in range(len(CUTS) - 1):
        a, b = CUTS[i], CUTS[i + 1]
        t = table(x8[a:b], x[a:b], y[a:b])
        pq.write_table(t, d / "train" / f"digits-{i:02d}.parquet", row_group_size=ROW_GROUP)
    pq.write_table(table(xt8, xt, yt), d / "test.parquet")
    np.savez(d / "whole.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    return {"d": d, "train": d / "train", "test": d / "test.parquet", "x8": x8, "y": y}


def test_inspect_reports_what_pyarrow_wrote(digits):
    d = describe(digits["train"])
    assert (d["format"], d["files"], d["rows"]) == ("parquet", 3, 480)
    files = sorted(digits["train"].iterdir())
    assert d["per_file"] == [
        {
            "file": str(f),
            "rows": pq.ParquetFile(f).metadata.num_rows,
            "row_groups": pq.ParquetFile(f).num_row_groups,
        }
        for f in files
    ]
    assert [f["rows"] for f in d["per_file"]] == [100, 250, 130]
    assert [f["row_groups"] for f in d["per_file"]] == [2, 4, 3]
    assert d["columns"] == {
        "image": {"type": "list<element: uint8>", "values": 784, "nulls": 0},
        "raw": {"type": "binary", "bytes": 784, "nulls": 0},
        "pixels": {"type": "fixed_size_list<element: float>[784]", "values": 784, "nulls": 0},
        "label": {"type": "int64", "values": 1, "nulls": 0},
        "source": {"type": "string", "nulls": 0},
    }
    code, out, _ = run_cli("data", "inspect", str(digits["test"]), "--json")
    t = json.loads(out)
    assert code == 0 and t["rows"] == 200 and t["per_file"][0]["row_groups"] == 1
    code, out, _ = run_cli("data", "inspect", str(digits["train"] / "*.parquet"))
    assert code == 0 and "Parquet, 3 files, 480 rows" in out, out
    assert re.search(r"raw +binary +784 bytes\n", out)
    assert re.search(r"source +string +not numbers\n", out)


def test_convert_gives_what_pyarrow_reads_back(digits, tmp_path):
    dest = tmp_path / "shards"
    code, out, err = run_cli(
        "data", "convert", str(digits["train"] / "digits-*.parquet"), str(dest),
        "--test", str(digits["test"]), "--shard-mb", "0.1",
        "--y", "label", "--x", "image", "--x-shape", "28,28",
    )  # a glob of files, as a directory  # fmt: skip
    assert code == 0, err
    assert "image (list<element: uint8>) -> uint8 28x28" in out
    assert "train 480 rows in 4 shards" in out
    files = sorted(digits["train"].iterdir())
    back = pa.concat_tables([pq.read_table(f) for f in files])
    want_x = np.stack([np.asarray(v, np.uint8) for v in back.column("image").to_pylist()])
    ds = data_mod.load("fashion-mnist", dest)
    x = np.asarray(ds.train.images)
    assert x.dtype == np.uint8 and x.shape == (480, 28, 28)
    np.testing.assert_array_equal(x, want_x.reshape(480, 28, 28))
    np.testing.assert_array_equal(ds.train.labels, back.column("label").to_numpy())
    np.testing.assert_array_equal(x, digits["x8"])
    test_back = pq.read_table(digits["test"])
    np.testing.assert_array_equal(ds.test.labels, test_back.column("label").to_numpy())
    # the raw bytes, as np.frombuffer reads pyarrow's values; the fixed-size float list
    for column, field, dtype, want in (
        ("raw", Field("x", "raw", None, (28, 28)), np.uint8,
         [np.frombuffer(v, np.uint8) for v in back.column("raw").to_pylist()]),
        ("pixels", Field("x", "pixels", None, (28, 28)), np.float32,
         list(back.column("pixels").combine_chunks().flatten().to_numpy().reshape(480, 784))),
    ):  # fmt: skip
        s = convert_parquet(
            digits["train"], digits["test"], tmp_path / column, field, Field("y", "label")
        )
        assert s.rows == {"train": 480, "test": 200}
        got = np.asarray(data_mod.load("fashion-mnist", tmp_path / column).train.images)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, np.stack(want).reshape(480, 28, 28))


def write(path, columns: dict, row_group_size: int = 2) -> None:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def test_the_mapping_is_checked_naming_the_file_row_and_column(tmp_path):
    """Row 2 is the first row of the second row group: rows are counted in the file."""
    u8 = pa.list_(pa.uint8())
    image = [[1, 2, 3, 4]] * 3
    label = [1, 2, 3]
    wrong = {
        "row 2: column 'image' holds 3 values; expected 4 (4 uint8)": {
            "image": pa.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3]], u8), "label": label,
        },
        "row 2: column 'label' holds a null": {
            "image": pa.array(image, u8), "label": pa.array([1, 2, None], pa.int64()),
        },
        "row 2: column 'image' holds a null": {
            "image": pa.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, None, 3, 4]], u8), "label": label,
        },
        "row 1: column 'image' holds a null": {
            "image": pa.array([[1, 2, 3, 4], None, [1, 2, 3, 4]], u8), "label": label,
        },
        "row 2: column 'label' holds 2 values; expected 1": {
            "image": pa.array(image, u8),
            "label": pa.array([[1], [2], [3, 4]], pa.list_(pa.int64())),
        },
    }  # fmt: skip
    for k, (message, columns) in enumerate(wrong.items()):
        path = tmp_path / f"t{k}.parquet"
        write(path, columns)
        with pytest.raises(DataError, match=re.escape(f"{path}: {message}")):
            convert_parquet(
                path, path, tmp_path / f"o{k}", Field("x", "image"), Field("y", "label")
            )
    path = tmp_path / "ok.parquet"
    write(path, {"image": pa.array(image, u8), "label": label})
    refused = {
        "no column 'pixels' (it has: image, label)": (Field("x", "pixels"), path),
        "column 'name' is string; expected numbers": (Field("x", "name"), None),
        "column 'nested' is list<element: list<element: uint8>>; expected numbers": (
            Field("x", "nested"), None,
        ),
        "row 3: column 'n' holds 300, which uint8 cannot hold exactly": (
            Field("x", "n", "uint8"), None,
        ),
        "column 'v' holds double values; --x-dtype uint8 would round them": (
            Field("x", "v", "uint8"), None,
        ),
    }  # fmt: skip
    odd = tmp_path / "odd.parquet"
    write(odd, {
        "name": ["a", "b", "c", "d"],
        "nested": pa.array([[[1]], [[2]], [[3]], [[4]]], pa.list_(pa.list_(pa.uint8()))),
        "n": pa.array([[1, 2], [3, 4], [5, 6], [7, 300]], pa.list_(pa.int64())),
        "v": [0.5, 1.5, 2.5, 3.5],
        "label": [1, 2, 3, 4],
    })  # fmt: skip
    for k, (message, (x, src)) in enumerate(refused.items()):
        src = src or odd
        with pytest.raises(DataError, match=re.escape(f"{src}: {message}")):
            convert_parquet(src, src, tmp_path / f"r{k}", x, Field("y", "label"))
    # another file whose column is another kind than the first file's
    other = tmp_path / "other.parquet"
    write(other, {"image": [b"\x01\x02\x03\x04"] * 3, "label": label})
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{other}: row 0: column 'image' is binary, but the first file's is list<element: "
            "uint8>"
        ),
    ):
        convert_parquet(path, other, tmp_path / "k", Field("x", "image"), Field("y", "label"))
    code, _, err = run_cli("data", "convert", str(path), str(tmp_path / "o"), "--x", "image")
    assert code == 2 and "Parquet input needs --test, --y" in err
    code, _, err = run_cli(
        "data", "convert", str(path), str(tmp_path / "o"), "--test", str(path),
        "--x", "image", "--y", "label", "--image-size", "2,2",
    )  # fmt: skip
    assert code == 2 and "--image-size is not for Parquet input" in err
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == []  # no refused conversion left a directory, not even a .partial one


def test_a_file_pyarrow_cannot_read_is_refused_naming_it(digits, tmp_path):
    src = digits["train"] / "digits-01.parquet"
    cut = tmp_path / "cut" / "digits.parquet"
    cut.parent.mkdir()
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(pa.ArrowInvalid):  # pyarrow agrees it is not readable
        pq.read_table(cut)
    with pytest.raises(DataError, match=re.escape(f"{cut}: not a readable Parquet file (pyarrow:")):
        describe(cut)
    # a flipped byte in a page whose checksum the writer stored: verified, as TFRecord's are
    t = pq.read_table(src)
    bad = tmp_path / "flip" / "digits.parquet"
    bad.parent.mkdir()
    pq.write_table(t, bad, row_group_size=ROW_GROUP, compression="none", write_page_checksum=True)
    data = bytearray(bad.read_bytes())
    at = data.index(digits["x8"][100 + 70].tobytes()) + 300  # a row of the second row group
    data[at] ^= 0x10
    bad.write_bytes(bytes(data))
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(bad, page_checksum_verification=True).read()
    message = f"{bad}: row group 1 (rows 64-127): not readable (pyarrow: "
    with pytest.raises(DataError, match=re.escape(message)):
        describe(bad)
    for name, path in (("cut", cut), ("flip", bad)):
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli(
            "data", "convert", str(path.parent), str(out), "--test", str(digits["test"]),
            "--x", "raw", "--y", "label",
        )  # fmt: skip
        assert code == 2 and f"ringtrain data convert: DataError: {path}: " in err, err
        assert not out.exists()  # whole or nothing
        assert not any(p.name.startswith(f"out-{name}.partial") for p in tmp_path.iterdir())


def test_without_pyarrow_the_commands_name_the_install(digits, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(DataError, match=re.escape("pip install 'ringtrain[data]'")):
        describe(digits["test"])
    code, _, err = run_cli(
        "data", "convert", str(digits["train"]), str(tmp_path / "o"), "--test",
        str(digits["test"]), "--x", "raw", "--y", "label",
    )  # fmt: skip
    assert code == 2 and "which is not installed (pip install 'ringtrain[data]')" in err
    assert not (tmp_path / "o").exists()
    # the trainer's data path does not need it: the shards' own refusal, not an ImportError
    with pytest.raises(DataError, match=r"Parquet files are trained from as \.npy shards"):
        data_mod.load("fashion-mnist", digits["train"])


def test_training_from_converted_parquet_equals_training_from_the_npz(digits, tmp_path):
    assert_converted_trains_as_the_npz("parquet", digits, tmp_path / "shards", digits["test"])


def test_convert_holds_a_batch_and_a_shard_in_memory_whatever_the_data_size(tmp_path):
    """256 MiB of 1 MiB rows in row groups of 4 rows, read twice (as train and as test) into
    4 MiB shards, peaks below the data's size: the interpreter with numpy and pyarrow (~110
    MiB), pyarrow's decoding of one row group (about 3x its size, measured) and one shard."""
    path = tmp_path / "big.parquet"
    rng = np.random.default_rng(2)
    chunk = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with pq.ParquetWriter(path, pa.schema({"x": pa.binary(), "y": pa.int64()})) as w:
        for g in range(64):
            rows = [chunk[i:] + chunk[:i] for i in range(g * 4, g * 4 + 4)]
            w.write_table(pa.table({"x": rows, "y": [i % 10 for i in range(4)]}))
    assert path.stat().st_size > 256 << 20
    out, peak_mib = run_measured(
        "data", "convert", str(path), str(tmp_path / "out"), "--test", str(path),
        "--x", "x", "--y", "y", "--shard-mb", "4",
    )  # fmt: skip
    assert "train 256 rows in 64 shards" in out
    assert pq.ParquetFile(path).num_row_groups == 64
    assert peak_mib < 208, peak_mib  # measured 175; 213 with 16 MiB row groups, 311 with 64
