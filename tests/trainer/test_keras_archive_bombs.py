"""A ``.keras`` archive is bounded before any member is inflated (issue 35): a config.json
zip bomb cost 5.7 GB; a weights.h5 bomb, or one far larger than the model's arrays, is refused
by its stated size with a message naming the file and the member."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import archive

TINY = {
    "class_name": "Sequential",
    "config": {
        "name": "tiny",
        "layers": [
            {"class_name": "InputLayer", "config": {"batch_shape": [None, 4]}},
            {"class_name": "Dense", "config": {"name": "d", "units": 2}},
        ],
    },
}


def _bomb(path, member: str, size: int, config: dict | None = None) -> None:
    """A .keras zip whose ``member`` inflates to ``size`` zero bytes (a few kB on disk)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("metadata.json", json.dumps({"keras_version": "3.6.0"}))
        if member != archive.CONFIG:
            zf.writestr(archive.CONFIG, json.dumps(config or TINY))
        else:
            zf.writestr(archive.WEIGHTS, b"")
        with zf.open(member, "w", force_zip64=True) as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(size >> 20):
                f.write(chunk)


def test_a_config_json_bomb_is_refused_by_its_stated_size(tmp_path):
    path = tmp_path / "bomb.keras"
    _bomb(path, archive.CONFIG, 64 << 20)
    with pytest.raises(InvalidSpec, match=r"config.json is 67,108,864 bytes uncompressed, over"):
        archive.read_keras(path)


def test_a_weights_bomb_beyond_the_models_arrays_is_refused(tmp_path):
    path = tmp_path / "bomb.keras"
    _bomb(path, archive.WEIGHTS, 64 << 20)
    with pytest.raises(
        InvalidSpec,
        match=r"model.weights.h5 is 67,108,864 bytes uncompressed, over [0-9,]+ \(10 weights",
    ):
        archive.read_keras(path)


def test_reading_a_bomb_costs_no_memory(tmp_path):
    """In a fresh process: refusing a 1 GiB config.json bomb raises the peak by a few MiB."""
    path = tmp_path / "bomb.keras"
    _bomb(path, archive.CONFIG, 1 << 30)
    code = (
        "import resource, sys\n"
        "from ringtrain_trainer.keras import load\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    load.load(sys.argv[1])\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120
    )
    *lines, grown = out.stdout.strip().splitlines()
    assert lines and lines[0].startswith("InvalidSpec"), out.stdout + out.stderr
    assert int(grown) < 64, out.stdout


def test_a_real_archive_within_the_bounds_still_reads_back(tmp_path):
    path = tmp_path / "ok.keras"
    kernel, bias = np.arange(8, dtype=np.float32).reshape(4, 2), np.ones(2, np.float32)
    archive.write_keras(path, TINY, [kernel, bias])
    _, weights = archive.read_keras(path, max_weight_bytes=1 << 20)
    assert [w.tobytes() for w in weights] == [kernel.tobytes(), bias.tobytes()]
