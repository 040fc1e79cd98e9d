import json

import pytest

from ringtrain_bench import step as bench_step


def test_bench_step_reports_both_sides_and_the_blas_in_use(capsys):
    rc = bench_step.main(["--steps", "4", "--warmup", "1", "--repeats", "1", "--threads", "1",
                          "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("samples_per_s", "torch_samples_per_s", "ratio_vs_torch", "gflops",
                "matmul_peak_gflops"):
        assert r[key] > 0, key
    # the ratio of the unrounded rates, so recomputing it from the printed (rounded) rates may
    # differ in the last digit
    assert abs(r["ratio_vs_torch"] - r["samples_per_s"] / r["torch_samples_per_s"]) < 2e-3
    assert any(i["internal_api"] == "openblas" and i["num_threads"] == 1 for i in r["blas"])


def test_bench_step_refuses_zero_workers(capsys):
    assert bench_step.main(["--workers", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_bench_step_two_workers_over_the_real_ring_reports_throughput_and_overlap(capsys):
    """Two real worker processes (TF_CONFIG, token, TCP ring) plus the one-worker baseline;
    ranges only, since two processes on a shared 2-core machine give noisy figures."""
    rc = bench_step.main(["--workers", "2", "--steps", "4", "--warmup", "2", "--repeats", "2",
                          "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["workers"], r["global_batch"], r["transport"]) == (2, 128, "grpc+tcp")
    assert len(r["samples_per_s_per_worker"]) == 2 and min(r["samples_per_s_per_worker"]) > 0
    # synchronous: each repeat lasts as long as its slowest worker
    assert 0 < r["global_samples_per_s"] <= 2 * min(r["samples_per_s_per_worker"]) + 0.2
    assert r["single_worker_samples_per_s"] > 0
    assert r["scaling_efficiency"] == pytest.approx(
        r["global_samples_per_s"] / (2 * r["single_worker_samples_per_s"]), abs=1e-3)
    assert 0.0 <= r["overlap_fraction"] <= 1.0
    assert r["allreduce_ms_per_step"] > 0 and r["exposed_wait_ms_per_step"] >= 0
    assert r["max_param_diff"] == 0.0  # the replicas stayed bit-identical
    assert "measure the ring transport" in r["note"]


def test_the_trainer_never_imports_the_benchmarks():
    """The benchmarks measure the trainer from outside (issue 9): no module of
    ``ringtrain_trainer``, the ring included, may depend on ``ringtrain_bench``."""
    import pathlib

    import ringtrain_trainer

    root = pathlib.Path(ringtrain_trainer.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "ringtrain_bench" in p.read_text()]
    assert offenders == []
