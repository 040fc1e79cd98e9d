"""``RINGTRAIN_KERNELS`` forces the engine's kernel set (issue 39): users run AVX2-only and
AVX-512 CPUs, so one machine must be able to run, state and measure each set it has. Read once at
the edge (the worker's config, ``ringtrain bench step``), refused where this CPU cannot run the
set, stated at start-up and in every bench line, and followed by the GEMM's choice.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringtrain.errors import InvalidSpec
from ringtrain_bench import step as bench_step
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import native


@pytest.fixture
def restored():
    """The widest set again after a test that forced one (request it before monkeypatch)."""
    yield
    native.force(native.WIDEST or "")


def test_an_unknown_set_or_one_this_cpu_lacks_is_refused_naming_the_variable(restored, monkeypatch):
    with pytest.raises(InvalidSpec, match=r"RINGTRAIN_KERNELS=sse9: .*avx512, avx2, baseline"):
        native.force("sse9")
    monkeypatch.setattr(native, "WIDEST", "avx2")  # an AVX2-only CPU, as the sets go
    with pytest.raises(InvalidSpec, match=r"RINGTRAIN_KERNELS=avx512: .*this CPU runs avx2, base"):
        native.force("avx512")
    assert native.kernels.isa() == "avx512" != native.WIDEST, "a refused set is not run"
    monkeypatch.setattr(native, "kernels", None)
    with pytest.raises(InvalidSpec, match="not built"):
        native.chosen("avx2")


def test_the_config_reads_the_variable_once_and_the_trainer_runs_it(restored, monkeypatch):
    """Checked at the edge (an InvalidSpec before anything compiles), case and spaces aside;
    the worker states the forced set where it states the kernels, and the GEMM follows it
    (a Dense's on AVX-512 only, ``GEMM_SETS``; a convolution's on AVX2 too, ``CONV_GEMM_SETS``)."""
    from ringtrain_bench.ipu_side import IPUSide

    assert TrainerConfig.from_args([], {}).kernels == ""
    assert TrainerConfig.from_args([], {"RINGTRAIN_KERNELS": " AVX2 "}).kernels == "avx2"
    with pytest.raises(InvalidSpec, match="RINGTRAIN_KERNELS=avx3"):
        TrainerConfig.from_args([], {"RINGTRAIN_KERNELS": "avx3"})
    args = bench_step.parser().parse_args(["--model", "cnn2", "--threads", "1", "--no-torch"])
    lines, gemm = {}, {}
    for name in ("avx2", "avx512"):
        side = IPUSide(args, cfg=TrainerConfig(kernels=name))
        try:
            lines[name] = side.trainer.ipu_lines()[0]
        finally:
            side.close()
        assert native.kernels.isa() == name
        gemm[name] = native.gemm_runs(64, np.float32), native.gemm_runs(6, np.float32, conv=True)
    native.force("baseline")
    gemm["baseline"] = native.gemm_runs(64, np.float32), native.gemm_runs(6, np.float32, conv=True)
    assert gemm == {"avx2": (False, True), "avx512": (True, True), "baseline": (False, False)}
    assert "native C (avx2, forced by RINGTRAIN_KERNELS; this CPU has avx512)" in lines["avx2"]
    assert "GEMM" not in lines["avx2"], lines["avx2"]
    assert lines["avx512"].startswith("compiled kernels: native C (avx512) for "), lines
    assert "GEMM" in lines["avx512"], lines["avx512"]


def test_bench_step_runs_and_names_the_forced_set_and_the_cpu(restored, monkeypatch, capsys):
    monkeypatch.setenv("RINGTRAIN_KERNELS", "baseline")
    argv = ["--steps", "2", "--warmup", "1", "--repeats", "1", "--threads", "1", "--no-torch"]
    assert bench_step.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kernels"] == "baseline" and native.kernels.isa() == "baseline"
    assert "forced by RINGTRAIN_KERNELS" in r["kernels_described"]
    assert r["cpu_model"] and r["cpu_model"] != "CPU model unknown"
    monkeypatch.setenv("RINGTRAIN_KERNELS", "avx1024")
    assert bench_step.main(argv) == 2
    assert "RINGTRAIN_KERNELS=avx1024" in capsys.readouterr().err
