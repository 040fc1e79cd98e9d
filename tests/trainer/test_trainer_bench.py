import json

from trainer import bench_step


def test_bench_step_reports_both_sides_and_the_blas_in_use(capsys):
    rc = bench_step.main(["--steps", "4", "--warmup", "1", "--repeats", "1", "--threads", "1",
                          "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("samples_per_s", "torch_samples_per_s", "ratio_vs_torch", "gflops",
                "matmul_peak_gflops"):
        assert r[key] > 0, key
    assert r["ratio_vs_torch"] == round(r["samples_per_s"] / r["torch_samples_per_s"], 3)
    assert any(i["internal_api"] == "openblas" and i["num_threads"] == 1 for i in r["blas"])


def test_bench_step_multi_worker_needs_the_ring_hook(capsys):
    assert bench_step.main(["--workers", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
