"""What the tests of ``ringtrain data inspect|convert`` share, whatever the source format
(TFRecord, Parquet, image folders): the real digits they write, the command run in-process or
in a child whose peak memory is measured, and the training run compared with a ``.npz``'s."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from ringtrain.cli import main as cli
from ringtrain.errors import DataError
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.data.convert import convert_fields
from ringtrain_trainer.data.mapping import Field
from ringtrain_trainer.data.rows import ShardedArray
from support.reference import single_worker_run

#: a child that runs the CLI and prints its own peak resident memory (VmHWM), in MiB: a spawned
#: child's ru_maxrss would count the test process's memory (TensorFlow's)
PEAK = (
    "import sys\n"
    "from ringtrain.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    'hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))\n'
    "print(int(hwm.split()[1]) // 1024)\n"
    "sys.exit(rc)\n"
)


def run_cli(*argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``ringtrain ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli(list(argv))
    return code, out.getvalue(), err.getvalue()


def run_measured(*argv) -> tuple[str, int]:
    """(stdout, peak MiB) of ``ringtrain ARGV`` in a fresh process, which must succeed."""
    out = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout, int(out.stdout.split()[-1])


def digit_samples() -> dict[str, np.ndarray]:
    """480 training and 200 test digits of mnist-5k, the same ones for every format's test:
    uint8 pixels (``x8``, ``xt8``), float32 ``x / 255`` (``x``, ``xt``), labels (``y``, ``yt``)."""
    m = data_mod.load_mnist5k()
    rng = np.random.default_rng(5)
    tr, te = rng.permutation(len(m.train))[:480], rng.permutation(len(m.test))[:200]
    x8, xt8 = m.train.images[tr], m.test.images[te]
    return {
        "x8": x8,
        "xt8": xt8,
        "x": (x8 / 255).astype(np.float32),
        "xt": (xt8 / 255).astype(np.float32),
        "y": m.train.labels[tr],
        "yt": m.test.labels[te],
    }


def train_both(shards, npz, lr: float = 0.05):
    """The seeds' trainer run alone on ``shards`` and on ``npz`` (6 steps of 24): both
    finished trainers, to compare weights and accuracy."""

    def cfg(data) -> TrainerConfig:
        return TrainerConfig(dataset="fashion-mnist", data_dir=str(data), optimizer="sgd", lr=lr,
                             seed=3, steps=6, eval_every=3, batch_size=24)  # fmt: skip

    return single_worker_run(cfg(shards)), single_worker_run(cfg(npz))


def assert_converted_trains_as_the_npz(fmt: str, digits: dict, dest, refused) -> None:
    """The digits' ``pixels`` (float32 ``x / 255``) and ``label`` fields of format ``fmt``
    (``tfrecord``, ``parquet``), converted into 6 uneven shards, train bit-identical weights to
    the same samples in ``whole.npz`` and the same test accuracy; the trainer given ``refused``
    (the source itself) refuses it naming the conversion."""
    s = convert_fields(
        fmt,
        digits["train"],
        digits["test"],
        dest,
        Field("x", "pixels", None, (28, 28)),
        Field("y", "label"),
        256 << 10,
    )
    assert s.rows == {"train": 480, "test": 200} and s.shards["train"] == 6
    shards, memory = train_both(dest, digits["d"] / "whole.npz")
    assert isinstance(shards.data.train.images, ShardedArray)
    np.testing.assert_array_equal(shards.params, memory.params)
    assert shards.test_accuracy == memory.test_accuracy
    name = {"tfrecord": "TFRecord", "parquet": "Parquet"}[fmt]
    with pytest.raises(DataError, match=rf"{name} files are trained from as \.npy shards: convert"):
        data_mod.load("fashion-mnist", refused)
