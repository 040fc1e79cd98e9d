import json

import pytest
from test_keras_layers import layer, seq

from ringtrain_bench import step as bench_step
from ringtrain_trainer.export import write_keras
from ringtrain_trainer.keras import load as KM


def test_bench_step_reports_both_sides_and_the_blas_in_use(capsys):
    rc = bench_step.main(
        ["--steps", "4", "--warmup", "1", "--repeats", "1", "--threads", "1", "--json"]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for key in (
        "samples_per_s",
        "torch_samples_per_s",
        "ratio_vs_torch",
        "gflops",
        "matmul_peak_gflops",
    ):
        assert r[key] > 0, key
    # the ratio of the unrounded rates, so recomputing it from the printed (rounded) rates may
    # differ in the last digit
    assert abs(r["ratio_vs_torch"] - r["samples_per_s"] / r["torch_samples_per_s"]) < 2e-3
    # PyTorch starts from ringtrain's weights too: the same loss on the first batch
    assert r["baselines"]["torch"]["same_start"]
    assert any(i["internal_api"] == "openblas" and i["num_threads"] == 1 for i in r["blas"])


@pytest.mark.timeout(300)
def test_bench_step_times_the_same_keras_model_in_tensorflow(tmp_path, capsys):
    """A tiny ``.keras`` file (ringtrain's own writer, so this process never imports
    TensorFlow) compiled with SGD: ringtrain and a TensorFlow child train it from the same
    weights with the same optimizer, interleaved; the JSON carries both sides, their quotient,
    the peak, and proof that TensorFlow ran as named and trained."""
    spec = KM.from_config(
        seq(
            (28, 28),
            layer("Flatten", "f"),
            layer("Dense", "h", units=8, activation="relu"),
            layer("Dense", "out", units=10),
            from_logits=True,
        )
    )
    config = spec.keras_config()
    config["compile_config"]["optimizer"] = {
        "module": "keras.optimizers",
        "class_name": "SGD",
        "config": {"learning_rate": 0.1, "momentum": 0.9},
        "registered_name": None,
    }
    path = write_keras(tmp_path / "tiny.keras", config, spec.keras_weights(spec.init(0)))
    argv = ["--model", str(path), "--baseline", "tensorflow", "--batch-size", "32"]
    argv += ["--steps", "3", "--warmup", "0", "--repeats", "2", "--threads", "1", "--json"]
    assert bench_step.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["baselines"]) == {"tensorflow"} and r["torch_samples_per_s"] is None
    tf = r["baselines"]["tensorflow"]
    assert r["tensorflow_samples_per_s"] == tf["samples_per_s"] > 0 and r["samples_per_s"] > 0
    assert r["ratio_vs_tensorflow"] == tf["ratio"] > 0
    assert abs(tf["ratio"] - r["samples_per_s"] / tf["samples_per_s"]) < 2e-3 * tf["ratio"] + 1e-3
    assert r["matmul_peak_gflops"] > 0 and r["matmul_peak_threads"] == 1
    for side in (r, tf):
        assert side["gflops"] > 0
        assert side["percent_of_peak"] == pytest.approx(
            100 * side["gflops"] / r["matmul_peak_gflops"], rel=2e-2, abs=2e-2
        )
        assert side["loss_last"] != side["loss_first"]
        # CPU time per step, the least of the blocks: every thread of the side's process
        assert 0 < side["cpu_ms_per_step"] <= 1e3 * max(side["block_seconds"]) / 3 * 2
    assert r["cpu_ratio_vs_tensorflow"] == tf["cpu_ratio"]
    assert tf["cpu_ratio"] == pytest.approx(
        tf["cpu_ms_per_step"] / r["cpu_ms_per_step"], rel=2e-3, abs=2e-3
    )
    rt = tf["runtime"]
    assert (rt["backend"], rt["jit_compile"], rt["optimizer"]) == ("tensorflow", False, "SGD")
    assert (rt["intra_op_threads"], rt["inter_op_threads"]) == (1, 1)
    assert rt["weights"] == spec.num_params
    assert tf["weights_moved"] > 0  # TensorFlow trained, not only ran forward
    # interleaved: each repeat one block of each side, the order rotating
    assert r["block_order"] == ["ipu", "tensorflow", "tensorflow", "ipu"]
    assert len(r["block_seconds"]) == len(tf["block_seconds"]) == 2
    assert tf["tf_function_traces"] == 1  # one compiled graph, no retracing while timed
    # the same model from the same weights: the same loss on ringtrain's first batch
    assert tf["same_start"] and tf["start_loss"] == pytest.approx(r["start_loss"], rel=1e-4)
    assert any(i["internal_api"] == "openblas" and i["architecture"] for i in r["blas"])


def test_bench_step_refuses_a_baseline_that_cannot_run_what_was_asked(tmp_path, capsys):
    assert bench_step.main(["--model", "no-such-model", "--baseline", "tensorflow"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert bench_step.main(["--workers", "2", "--baseline", "tensorflow"]) == 2
    assert "one worker" in capsys.readouterr().err
    path = tmp_path / "m.json"
    path.write_text(json.dumps(KM.preset_config("cnn")))
    argv = ["--model", str(path), "--baseline", "torch", "--steps", "1", "--repeats", "1"]
    assert bench_step.main([*argv, "--warmup", "0"]) == 2
    assert "the PyTorch side has only the presets" in capsys.readouterr().err


def test_bench_step_refuses_zero_workers(capsys):
    assert bench_step.main(["--workers", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_bench_step_two_workers_measures_overlapped_serialized_and_no_comm(capsys):
    """Two real worker processes (TF_CONFIG, token, TCP ring), each timing the same steps
    overlapped, serialized and without communication. Structural facts, not tight ratios
    (two processes on a shared 2-core machine give noisy figures): switching overlap off
    must show as hiding nothing, and the overlapped run must have started reducing before
    backward ended and hidden something, which waiting for the peer does not count as."""
    rc = bench_step.main(
        ["--workers", "2", "--steps", "4", "--warmup", "2", "--repeats", "2", "--json"]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["workers"], r["global_batch"], r["transport"]) == (2, 128, "grpc+tcp")
    v = r["variants"]
    assert set(v) == {"overlapped", "serialized", "no_comm"}
    for x in v.values():
        assert len(x["samples_per_s_per_worker"]) == 2 and min(x["samples_per_s_per_worker"]) > 0
    ov, ser, none = v["overlapped"], v["serialized"], v["no_comm"]
    for x in (ov, ser):  # synchronous: each repeat lasts as long as its slowest worker
        assert 0 < x["global_samples_per_s"] <= 2 * min(x["samples_per_s_per_worker"]) + 0.2
    assert none["global_samples_per_s"] > 0  # not in lockstep: the workers' summed rate
    # serialized hides nothing by construction; overlapped starts bucket 0 during backward
    assert ser["reducer_hidden_ms_per_step"] == 0 and ser["lead_ms_per_step"] == 0
    assert ov["lead_ms_per_step"] > 0 and ov["reducer_hidden_ms_per_step"] > 0
    assert ov["reducer_overlap_fraction"] > ser["reducer_overlap_fraction"] == 0
    # the ring reports its blocked time; the no-op collective has none
    for x in (ov, ser):
        assert x["allreduce_ms_per_step"] > 0 and x["peer_wait_ms_per_step"] > 0
        assert (
            x["reducer_hidden_ms_per_step"] + x["peer_wait_ms_per_step"]
            <= x["allreduce_ms_per_step"] + 1e-3
        )
    assert none["peer_wait_ms_per_step"] == 0
    assert ser["exposed_wait_ms_per_step"] >= ser["allreduce_ms_per_step"] - 1e-3
    assert r["exposed_comm_ms_per_step"] == pytest.approx(ov["step_ms"] - none["step_ms"], abs=2e-3)
    if ser["step_ms"] > none["step_ms"]:
        assert r["hidden_fraction"] == pytest.approx(
            (ser["step_ms"] - ov["step_ms"]) / (ser["step_ms"] - none["step_ms"]), abs=1e-3
        )
    assert r["scaling_efficiency"] == pytest.approx(
        r["global_samples_per_s"] / none["global_samples_per_s"], abs=2e-3
    )
    assert set(r["definitions"]) >= {
        "hidden_fraction",
        "scaling_efficiency",
        "exposed_comm_ms_per_step",
    }
    assert r["max_param_diff"] == 0.0  # the replicas stayed bit-identical
    assert "without communication" in r["note"]


def test_the_trainer_never_imports_the_benchmarks():
    """The benchmarks measure the trainer from outside (issue 9): no module of
    ``ringtrain_trainer``, the ring included, may depend on ``ringtrain_bench``."""
    import pathlib

    import ringtrain_trainer

    root = pathlib.Path(ringtrain_trainer.__file__).parent
    offenders = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if "ringtrain_bench" in p.read_text()
    ]
    assert offenders == []
