"""`ringtrain bench step --numerics` end to end at a tiny size: one run reports fp32 vs fp16 ms
per step and K=1 vs K=4 allreduce time per sample, with the global batches they divide by."""

import json
import subprocess

import pytest
from support.procs import CLI


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_step_numerics_reports_precision_and_accumulation():
    argv = ["--numerics", "--steps", "2", "--warmup", "1", "--repeats", "1", "--threads", "1"]
    out = subprocess.run(
        [*CLI, "bench", "step", *argv, "--batch-size", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["step_ms"]["fp32"] > 0 and r["step_ms"]["fp16"] > 0
    acc = r["accumulation"]
    assert acc["workers"] == 2
    assert (acc["K=1"]["global_batch"], acc["K=4"]["global_batch"]) == (32, 128)
    for k in ("K=1", "K=4"):
        a = acc[k]
        assert a["allreduce_ms_per_step"] > 0
        assert a["allreduce_us_per_sample"] == pytest.approx(
            a["allreduce_ms_per_step"] * 1e3 / a["global_batch"], rel=1e-2
        )
        assert 0 <= a["ring_us_per_sample"] <= a["allreduce_us_per_sample"]
