import json
import os
import signal
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from support.procs import WORKER, without_cluster

from ringtrain.errors import EXIT_PERMANENT, EXIT_TERMINATED, InvalidSpec
from ringtrain_trainer import worker, worker_main
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.telemetry.metrics import TrainerMetrics
from ringtrain_trainer.telemetry.server import MetricsServer


def test_json_run_on_mnist5k_learns_and_writes_the_termination_log(tmp_path, capsys):
    log = tmp_path / "termination-log"
    rc = worker_main.main(
        [
            "--dataset",
            "mnist-5k",
            "--epochs",
            "2",
            "--json",
            "--eval-every",
            "60",
            "--termination-log",
            str(log),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    progress = [e for e in lines if e["event"] == "progress"]
    assert progress and all(
        {"step", "epoch", "loss", "samples_per_s", "eta_s"} <= e.keys() for e in progress
    )
    assert [e["step"] for e in lines if e["event"] == "eval"] == [60, 120, 124]
    final = lines[-1]
    assert final["event"] == "final" and final["steps"] == 124 and final["samples_per_s"] > 0
    assert final["test_accuracy"] >= 0.85  # chance is 0.10
    assert progress[-1]["loss"] < progress[0]["loss"] / 3
    assert json.loads(log.read_text()) == final
    assert final["checkpoint"].endswith("ckpt-0000000124.json")


def test_human_progress_lines(capsys):
    assert worker_main.main(["--dataset", "mnist-5k", "--steps", "3", "--termination-log", ""]) == 0
    out = capsys.readouterr().out
    assert "step 1/3 (33%)  epoch 0  loss " in out and "samples/s  ETA 0:0" in out
    assert "step 3  test accuracy " in out
    assert "done: 3 steps" in out and "test accuracy" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-dir", "/nonexistent"], "/nonexistent: data directory does not exist"),
        (["--dataset", "mnist-5k", "--ipus-per-worker", "3"], "does not divide evenly"),
        (["--dataset", "mnist-5k", "--ipu-memory-mb", "2"], "bytes needed"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
    ],
)
def test_bad_input_is_a_permanent_failure(tmp_path, capsys, argv, message):
    log = tmp_path / "log"
    assert worker_main.main([*argv, "--termination-log", str(log)]) == EXIT_PERMANENT
    assert message in capsys.readouterr().err
    assert json.loads(log.read_text())["exit_code"] == EXIT_PERMANENT


def test_config_reads_tf_config_and_token_once(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    env = {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": ["a:2222", "b:2222"]}, "task": {"type": "worker", "index": 1}}
        ),
        "RINGTRAIN_TOKEN_FILE": str(tok),
    }
    cfg = TrainerConfig.from_args(["--batch-size", "32"], env)
    assert (cfg.cluster.rank, cfg.cluster.world_size, cfg.token) == (1, 2, b"s3cret")
    assert cfg.epochs == 1 and cfg.batch_size == 32 and cfg.bucket_bytes == 25 << 20
    with pytest.raises(InvalidSpec, match=r"TF_CONFIG\.task\.index"):
        TrainerConfig.from_args(
            [], {"TF_CONFIG": '{"cluster":{"worker":["a:1"]},"task":{"type":"worker","index":4}}'}
        )


def test_sigterm_checkpoints_and_exits_143(tmp_path):
    env = dict(without_cluster(), OPENBLAS_NUM_THREADS="1")
    with subprocess.Popen(
        [
            *WORKER,
            "--dataset",
            "mnist-5k",
            "--epochs",
            "1000",
            "--json",
            "--checkpoint-dir",
            str(tmp_path),
            "--termination-log",
            str(tmp_path / "log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            first = json.loads(proc.stdout.readline())  # training has started
            assert first["event"] == "progress"
            proc.send_signal(signal.SIGTERM)
            rest = proc.stdout.read()
            assert proc.wait(timeout=60) == EXIT_TERMINATED
        finally:
            proc.kill()
    final = json.loads(rest.splitlines()[-1])
    assert final["terminated"] is True and final["checkpoint"]
    assert json.loads((tmp_path / "log").read_text())["terminated"] is True
    assert (tmp_path / os.path.basename(final["checkpoint"])).exists()


def test_metrics_and_status_endpoints(mnist5k):
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    server = MetricsServer(metrics, 0, host="127.0.0.1")
    try:
        cfg = TrainerConfig(dataset="mnist-5k", steps=5, batch_size=32)
        t = worker.Trainer(cfg, LocalCollective(), mnist5k, metrics=metrics)
        t.run()
        t.close()
        base = f"http://127.0.0.1:{server.port}"
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        status = json.loads(urllib.request.urlopen(base + "/status").read())
    finally:
        server.close()
    assert "ringtrain_step_duration_seconds_bucket" in text
    assert status["step"] == 5 and status["phase"] == "Succeeded"
    assert status["test_accuracy"] is not None
    get = registry.get_sample_value
    assert get("ringtrain_steps_total") == 5
    assert get("ringtrain_step_duration_seconds_count") == 5
    n = t.spec.num_params
    assert get("ringtrain_ipu_stream_bytes_total", {"direction": "weights_in"}) == 5 * n * 4
    assert get("ringtrain_ipu_stream_bytes_total", {"direction": "grads_out"}) == 5 * n * 4
    plan = t.exe.plan
    by_kind = {k: get("ringtrain_ipu_memory_bytes", {"kind": k}) for k in plan.kinds()}
    assert by_kind == plan.kinds() and sum(by_kind.values()) == plan.total
    assert status["ipu_memory"]["total"] == plan.total  # the memory report in /status
    # Adam (the default) keeps its two slots on the host (variables on host, the default)
    assert get("ringtrain_host_memory_bytes", {"kind": "optimizer_state"}) == 2 * n * 4
    assert get("ringtrain_ipu_recompiles_total") == 0  # train and eval programs, compiled once
    assert get("ringtrain_loss") > 0 and get("ringtrain_samples_per_second") > 0
    # the steps' waits for their batches: counted, the last one in /status (data.feed)
    assert 0 < get("ringtrain_data_wait_seconds_total") < 5 * 0.5
    assert status["data_wait_s"] == round(t.feed.wait_s, 6)


def test_a_small_ipu_evaluates_in_training_sized_batches(mnist5k):
    # 10 MB: the evaluation batch (500) does not fit, a training-sized one does (the compiled
    # first layer keeps no conv map: 20 MB held the whole evaluation batch)
    cfg = TrainerConfig(dataset="mnist-5k", steps=2, batch_size=16, ipu_memory_mb=10)
    t = worker.Trainer(cfg, LocalCollective(), mnist5k)
    try:
        final = t.run()
    finally:
        t.close()
    assert t.eval_batch == 16 and final["test_accuracy"] is not None
