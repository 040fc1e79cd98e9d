"""`ringtrain run` says why a job failed and keeps the replicas' logs (issue 34): the worker's own
words in the summary and the --json final event; each replica's output in
``<run dir>/pods/<pod>/log``, rotated by size, printed by `ringtrain logs`; an unknown command
says so."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.procs import ringtrain
from test_local_run import command_job, run, tiny_job, write

from ringtrain_localrun import cli, logs, plan, supervisor

WHY = "not a readable .npz archive"


@pytest.fixture
def bad_data_job(tmp_path: Path) -> Path:
    """Two workers whose --data is a file that is no .npz archive (a data error: exit 2)."""
    data = tmp_path / "mydata"
    data.mkdir()
    (data / "d.npz").write_text("garbage\n")
    obj = tiny_job(
        "baddata",
        dataset="fashion-mnist",
        data={"volume": {"hostPath": {"path": str(data)}}, "file": "d.npz"},
    )
    return write(tmp_path, obj)


def test_a_data_error_says_the_workers_reason_in_the_json_final_event(bad_data_job, tmp_path):
    out = run([str(bad_data_job), "--json", "--run-dir", str(tmp_path / "run")], cwd=tmp_path)
    assert out.returncode == cli.EXIT_FAILED, out.stderr[-3000:]
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert (final["phase"], final["reason"]) == ("Failed", "TrainingJobFailed")
    data_file = str(tmp_path / "mydata" / "d.npz")
    assert "failed with exit code 2: permanent under restartPolicy ExitCode: " in final["message"]
    assert f"DataError: {data_file}: {WHY}" in final["message"]
    # the host path is the pod's /data/d.npz: said, so the user knows what was looked up
    assert (
        f"({data_file} is /data/d.npz in the pod (volume data, mounted at /data))"
        in (final["message"])
    )
    # the Warning status event carries the same words; the run dir keeps the final object
    warnings = [
        e for e in map(json.loads, out.stdout.splitlines()) if e.get("reason") == final["reason"]
    ]
    assert warnings and WHY in warnings[-1]["message"]
    assert json.loads((tmp_path / "run" / "final.json").read_text()) == final
    start = json.loads(out.stdout.splitlines()[0])
    assert start["replicas"]["worker-1"]["log"] == str(
        tmp_path / "run" / "pods" / "baddata-worker-1" / "log"
    )


def test_a_data_error_says_the_workers_reason_in_the_summary_and_keeps_the_logs(
    bad_data_job, tmp_path
):
    run_dir = tmp_path / "run"
    out = run([str(bad_data_job), "--run-dir", str(run_dir)], cwd=tmp_path)
    assert out.returncode == cli.EXIT_FAILED, out.stdout[-3000:]
    summary = out.stdout[out.stdout.index("TrainingJob baddata: Failed") :]
    why = next(line for line in summary.splitlines() if line.startswith("  why "))
    assert "exit code 2" in why and f"DataError: {tmp_path / 'mydata' / 'd.npz'}: {WHY}" in why
    assert f"logs and data  {run_dir}" in summary
    assert f"its log        ringtrain logs {run_dir} --replica worker-" in summary
    # the logs are where the summary says, and `ringtrain logs` prints them
    for pod in ("baddata-worker-0", "baddata-worker-1"):
        assert WHY in (run_dir / "pods" / pod / "log").read_text()
    one = ringtrain("logs", str(run_dir), "--replica", "worker-1")
    assert one.returncode == 0 and WHY in one.stdout
    assert not any(line.startswith("worker-") for line in one.stdout.splitlines())
    every = ringtrain("logs", str(run_dir))
    assert {line.split("|")[0].strip() for line in every.stdout.splitlines()} == {
        "worker-0",
        "worker-1",
    }
    by_name = ringtrain("logs", "baddata", cwd=tmp_path)  # no .ringtrain/runs here
    assert by_name.returncode == 2 and "--backend kubernetes" in by_name.stderr
    unknown = ringtrain("logs", str(run_dir), "--replica", "worker-7")
    assert unknown.returncode == 2 and "replicas: worker-0, worker-1" in unknown.stderr


FLAKY_ONCE = """
import os, sys
first = not os.path.exists("tried")
open("tried", "w").close()
print("attempt", "first" if first else "second", flush=True)
sys.exit(138 if first else 0)
"""


def test_a_replica_restarted_in_place_appends_to_its_log_after_a_marker(tmp_path):
    run_dir = tmp_path / "run"
    job = command_job("flaky", FLAKY_ONCE, replicas=1, backoffLimit=2)
    out = run([str(write(tmp_path, job)), "--run-dir", str(run_dir)], cwd=tmp_path, timeout=60)
    assert out.returncode == cli.EXIT_SUCCEEDED, out.stdout[-3000:]
    assert (run_dir / "pods" / "flaky-worker-0" / "log").read_text().splitlines() == [
        "attempt first",
        logs.RESTART_MARK.format(label="worker-0", n=1),
        "attempt second",
    ]


def test_a_log_is_rotated_by_size_keeping_the_newest_output(tmp_path):
    log = logs.ReplicaLog(tmp_path / "pods" / "j-worker-0" / "log", max_bytes=100)
    lines = [f"line {i:03d} " + "x" * 10 for i in range(40)]  # 19 bytes each
    for line in lines:
        log.write(line)
    log.close()
    current, rotated = (tmp_path / "pods" / "j-worker-0" / n for n in ("log", "log.1"))
    assert current.stat().st_size <= 100 and rotated.stat().st_size <= 100
    kept = rotated.read_text().splitlines() + current.read_text().splitlines()
    assert kept == lines[-len(kept) :] and len(kept) >= 100 // 19  # the newest, in order
    printed = ringtrain("logs", str(tmp_path))
    assert printed.stdout.splitlines() == kept


def test_follow_prints_what_is_appended_across_rotations_until_the_run_ends(tmp_path):
    log = logs.ReplicaLog(tmp_path / "pods" / "j-worker-0" / "log", max_bytes=60)
    lines = [f"line {i}" for i in range(50)]
    log.write(lines[0])

    def writer() -> None:
        for line in lines[1:]:
            log.write(line)
            time.sleep(0.002)
        log.close()
        (tmp_path / logs.FINAL_NAME).write_text("{}")

    class Out:
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    out = Out()
    t = threading.Thread(target=writer)
    t.start()
    code = logs.print_logs(tmp_path, None, True, out, poll_s=0.001)  # type: ignore[arg-type]
    t.join()
    assert code == 0 and out.text.splitlines() == lines


def test_with_fallback_to_logs_on_error_a_failure_without_termination_log_is_its_logs_tail(
    tmp_path,
):
    """terminationMessagePolicy FallbackToLogsOnError, as the kubelet applies it."""
    _, (replica,) = plan.plan(command_job("user", "pass", replicas=1), tmp_path)
    assert replica.termination_log is None and replica.log == str(
        tmp_path / "pods" / "user-worker-0" / "log"
    )
    log = logs.ReplicaLog(Path(replica.log))
    for i in range(100):
        log.write(f"output {i}")
    log.write("ValueError: my script's own reason")
    log.close()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    assert replica.termination_message_policy == "FallbackToLogsOnError"  # ringtrain's default
    file = dataclasses.replace(replica, termination_message_policy="File")
    assert supervisor.observed_pod(file, proc).termination_message is None
    message = supervisor.observed_pod(replica, proc).termination_message
    assert message is not None and message.endswith("ValueError: my script's own reason")
    assert len(message.splitlines()) <= 80 and len(message.encode()) <= 2048


def test_an_unknown_command_says_so_and_lists_the_commands():
    out = ringtrain("lgs")
    assert out.returncode == 2
    assert "unknown command 'lgs' (did you mean 'logs'?)" in out.stderr
    assert "  logs " in out.stderr and "  run " in out.stderr


@pytest.mark.parametrize(
    "pod,label",
    [("my-job-worker-12", "worker-12"), ("x-chief-0", "chief-0"), ("hvd-launcher", "launcher-0")],
)
def test_a_pod_directory_is_named_by_its_replica_as_the_run_names_it(pod, label):
    assert logs.label_of(pod) == label
