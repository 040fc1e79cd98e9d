"""`ringtrain run`: a TrainingJob as local processes.

Planning is tested as a pure translation of the operator's Pods; running is tested with real
processes — the real trainer for the happy path, and small Python commands in a user's own pod
template (a job without spec.trainer) for failures and signals, where the outcome must not
depend on training speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.procs import CLI, ringtrain
from support.reference import single_worker_run

from ringtrain import cluster, events
from ringtrain_localrun import cli, console, jobstate, plan, supervisor
from ringtrain_operator import manifests
from ringtrain_operator import spec as jobspec

ROOT = Path(__file__).resolve().parents[2]
RUN = [*CLI, "run"]


def tiny_job(name: str = "tiny", **trainer) -> dict:
    return {
        "apiVersion": jobspec.API_VERSION,
        "kind": jobspec.KIND,
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"Worker": {"replicas": 2}},
            "trainer": {
                "dataset": "mnist-5k",
                "steps": 6,
                "batchSize": 16,
                "evalEvery": 3,
                **trainer,
            },
        },
    }


def command_job(
    name: str, worker_code: str, replicas: int = 2, restart_policy: str = "ExitCode", **run_policy
) -> dict:
    """A job whose workers run ``python -c worker_code`` from the pod template (no spec.trainer)."""
    container = {
        "name": "main",
        "image": "python:3.11-slim-bookworm",
        "command": [sys.executable, "-c", worker_code],
    }
    return {
        "apiVersion": jobspec.API_VERSION,
        "kind": jobspec.KIND,
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "restartPolicy": restart_policy,
                    "template": {"spec": {"containers": [container]}},
                }
            },
            "runPolicy": run_policy,
        },
    }


def write(tmp_path: Path, obj: dict) -> Path:
    path = tmp_path / f"{obj['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


# ---- planning ------------------------------------------------------------------------------------


def test_plan_of_the_shipped_example_gives_each_worker_a_loopback_ring(tmp_path):
    obj = plan.read_job(str(ROOT / "examples" / "fashion-mnist-2workers.yaml"))
    _, replicas = plan.plan(obj, tmp_path)
    assert [r.name for r in replicas] == ["fashion-mnist-worker-0", "fashion-mnist-worker-1"]
    specs = [cluster.parse(r.env["TF_CONFIG"]) for r in replicas]
    ring = specs[0].ring
    assert all(s.ring == ring for s in specs), "every replica must see the same cluster"
    assert len(set(ring)) == 2 and all(a.startswith("127.0.0.1:") for a in ring)
    assert [s.rank for s in specs] == [0, 1]
    for r in replicas:
        assert r.argv[:4] == (sys.executable, "-m", "ringtrain.cli", "worker")
        args = list(r.argv)
        # In-pod paths are redirected into the run directory.
        assert args[args.index("--checkpoint-dir") + 1] == str(tmp_path / "checkpoints")
        assert args[args.index("--termination-log") + 1].startswith(str(tmp_path / "pods"))
        assert args[args.index("--metrics-port") + 1] == str(r.metrics_port)
        token_file = r.env["RINGTRAIN_TOKEN_FILE"]
        assert token_file.startswith(str(tmp_path)) and token_file in r.files
    assert len({r.metrics_port for r in replicas}) == 2
    tokens = {r.files[r.env["RINGTRAIN_TOKEN_FILE"]] for r in replicas}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32, "one shared, random ring token"


def test_plan_uses_the_operators_pods_so_render_and_run_agree(tmp_path):
    obj = tiny_job()
    job, replicas = plan.plan(obj, tmp_path)
    pods = [o for o in manifests.desired_objects(job) if o["kind"] == "Pod"]
    for pod, r in zip(pods, replicas, strict=True):
        c = pod["spec"]["containers"][0]
        # Same flags as on the cluster, except the values that name in-pod paths and ports.
        cluster_flags = [a for a in c["args"] if a.startswith("--")]
        local_flags = [a for a in r.argv if a.startswith("--")]
        assert cluster_flags == local_flags
        assert {e["name"] for e in c["env"]} == set(r.env)


def test_invalid_job_exits_2_naming_the_field(tmp_path, capsys):
    obj = tiny_job()
    obj["spec"]["trainer"]["batchsize"] = 32  # typo
    code = cli.main([str(write(tmp_path, obj)), "--run-dir", str(tmp_path / "run")])
    assert code == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.trainer" in err and "batchsize" in err


def test_file_without_exactly_one_trainingjob_is_rejected(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([tiny_job("a"), tiny_job("b")]))
    with pytest.raises(jobspec.InvalidSpec, match="exactly one TrainingJob"):
        plan.read_job(str(path))


@pytest.mark.parametrize(
    "code,phase,exit_code,reason",
    [
        ("pass", "Succeeded", 0, None),
        ("raise SystemExit(3)", "Failed", 3, None),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "Failed", 137, "SIGKILL"),
    ],
)
def test_an_exited_process_is_observed_as_the_pod_kubernetes_would_report(
    code, phase, exit_code, reason
):
    """The fold judges exit codes the way the kubelet reports them: signal n is 128 + n. Under
    restartPolicy Never the pod ends; under ExitCode (Pod restartPolicy OnFailure) a failed one
    stays Running with its exit in state.terminated, about to restart in place."""
    _, (replica, _) = plan.plan(tiny_job(), Path("/nonexistent"))
    assert replica.restart_policy == "OnFailure"
    proc = subprocess.Popen([sys.executable, "-c", code])
    proc.wait()
    never = supervisor.observed_pod(dataclasses.replace(replica, restart_policy="Never"), proc)
    assert (never.name, never.role, never.index) == ("tiny-worker-0", "worker", 0)
    assert (never.phase, never.exit_code, never.exit_reason, never.ready) == (
        phase,
        exit_code,
        reason,
        False,
    )
    assert not never.restarting
    pod = supervisor.observed_pod(replica, proc)
    assert (pod.phase, pod.exit_code, pod.exit_reason, pod.ready, pod.restarting) == (
        (phase, exit_code, reason, False, False)
        if exit_code == 0
        else ("Running", exit_code, reason, False, True)
    )


def test_a_process_restarted_in_place_shows_restart_count_and_last_state():
    _, (replica, _) = plan.plan(tiny_job(), Path("/nonexistent"))
    old = subprocess.Popen([sys.executable, "-c", "raise SystemExit(138)"])
    old.wait()
    proc = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    try:
        pod = supervisor.observed_pod(replica, proc, restarts=1, last=old)
        assert (
            pod.phase,
            pod.ready,
            pod.restarts,
            pod.last_exit_code,
            pod.exit_code,
            pod.restarting,
        ) == ("Running", True, 1, 138, None, False)
    finally:
        proc.communicate(b"\n")


def test_a_running_process_is_a_ready_running_pod():
    _, (replica, _) = plan.plan(tiny_job(), Path("/nonexistent"))
    proc = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    try:
        pod = supervisor.observed_pod(replica, proc)
        assert (pod.phase, pod.ready, pod.exit_code) == ("Running", True, None)
    finally:
        proc.communicate(b"\n")


def test_progress_line_shows_step_loss_rate_eta_and_health():
    line = console.format_progress(
        {
            "step": 120,
            "total_steps": 500,
            "epoch": 0.25,
            "loss": 0.41234,
            "samples_per_s": 8412.3,
            "eta_s": 45,
            "test_accuracy": None,
            "restarts": 1,
            "workers": {"worker-0": "ok", "worker-1": "exit 138"},
        }
    )
    assert line == (
        "step 120/500 (24%)  epoch 0.25  loss 0.4123  8,412 samples/s  ETA 0:45  "
        "restarts 1  [worker-0 ok worker-1 exit 138]"
    )


def test_the_progress_line_says_when_its_accuracy_was_evaluated():
    """The accuracy is the last evaluation's, not this step's: the line names its step."""
    state = jobstate.JobState(None, 0.0, {"worker-0": jobstate.WorkerState()})
    state.observe("worker-0", events.Eval(step=100, test_accuracy=0.912), 1.0, chief=True)
    state.observe("worker-0", events.Progress(step=120, loss=0.4), 2.0, chief=True)
    line = console.format_progress(state.progress(2.0))
    assert "acc 91.20% at step 100" in line


# ---- running real processes ----------------------------------------------------------------------


def run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return ringtrain("run", *args, cwd=cwd, timeout_s=timeout)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]  # every line must be JSON


def test_two_worker_training_run_succeeds_with_json_progress_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    out = run(
        [
            str(write(tmp_path, tiny_job())),
            "--json",
            "--run-dir",
            str(run_dir),
            "--progress-interval",
            "0",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    events = json_lines(out.stdout)
    assert events[0]["event"] == "start" and set(events[0]["replicas"]) == {"worker-0", "worker-1"}
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all("step" in e for e in progress)
    assert max(e["step"] or 0 for e in progress) == 6
    assert progress[-1]["phase"] == "Succeeded" and progress[-1]["restarts"] == 0
    final = events[-1]
    assert final["event"] == "final" and final["phase"] == "Succeeded"
    assert (final["reason"], final["restarts"]) == ("TrainingJobSucceeded", 0)
    assert final["steps"] == 6 and 0.0 <= final["test_accuracy"] <= 1.0
    assert final["exit_codes"] == {"worker-0": 0, "worker-1": 0}
    assert Path(final["checkpoint"]).exists()
    assert Path(final["checkpoint"]).is_relative_to(run_dir / "checkpoints")
    # Replica logs are on stderr, prefixed with role and index; processes of one host share
    # memory on the ring, and each says so.
    assert "worker-0  |" in out.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank}: data path grpc+shm: tensors from the left neighbour over shm, "
            "to the right over shm"
        ) in out.stderr, out.stderr[-3000:]
    # The ring token was private to the user.
    (token,) = (run_dir / "pods").glob("*-worker-0/secrets/ring-token/token")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_a_grpc_ring_runs_over_mutual_tls_from_the_jobs_secret_and_matches_one_worker(tmp_path):
    """The Secret's TLS files land 0600 in the run dir, the workers load them through
    RINGTRAIN_TLS_DIR and train over mutual-TLS gRPC; the result is the single worker's with the
    global batch (the allreduce was exact)."""
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.ring.tls import INSECURE_NOTE

    run_dir = tmp_path / "run"
    out = run(
        [
            str(write(tmp_path, tiny_job(ring={"transport": "grpc"}))),
            "--json",
            "--run-dir",
            str(run_dir),
            "--progress-interval",
            "0",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    final = json_lines(out.stdout)[-1]
    assert final["phase"] == "Succeeded" and final["steps"] == 6
    secret_dir = next((run_dir / "pods").glob("*-worker-1/secrets/ring-token"))
    for name in ("ca.crt", "tls.crt", "tls.key"):
        assert stat.S_IMODE((secret_dir / name).stat().st_mode) == 0o600
    key = (secret_dir / "tls.key").read_text()
    assert INSECURE_NOTE not in out.stderr and key.splitlines()[1] not in out.stderr + out.stdout
    single = single_worker_run(
        TrainerConfig(dataset="mnist-5k", steps=6, batch_size=32, eval_every=3)
    )
    assert final["test_accuracy"] == pytest.approx(single.test_accuracy, abs=2e-3)


def test_human_output_ends_with_a_summary(tmp_path):
    out = run(
        [str(write(tmp_path, tiny_job(steps=2, evalEvery=0))), "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.split("TrainingJob tiny: Succeeded", 1)[1]
    for label in ("steps", "test accuracy", "time", "checkpoint", "exit codes"):
        assert label in summary


FAIL_WORKER_1 = """
import json, os, signal, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
if task["index"] == 1:
    print("worker 1 gives up", flush=True)
    sys.exit(3)
signal.pause()   # worker 0 would wait for its peer forever: the runner must stop it
"""


def test_a_failed_worker_fails_the_job_and_stops_the_others(tmp_path):
    out = run(
        [
            str(write(tmp_path, command_job("broken", FAIL_WORKER_1))),
            "--json",
            "--run-dir",
            str(tmp_path / "run"),
            "--grace-period",
            "5",
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == cli.EXIT_FAILED, out.stderr
    final = json_lines(out.stdout)[-1]
    assert (final["phase"], final["reason"], final["restarts"]) == (
        "Failed",
        "TrainingJobFailed",
        0,
    )
    # the script wrote no termination log: under FallbackToLogsOnError its log's tail says why
    assert final["message"] == (
        "pod broken-worker-1 failed with exit code 3: permanent under restartPolicy ExitCode: "
        "worker 1 gives up"
    )
    assert final["exit_codes"] == {"worker-0": 128 + signal.SIGTERM, "worker-1": 3}
    assert "worker-1  | worker 1 gives up" in out.stderr


def test_active_deadline_fails_the_job(tmp_path):
    job = command_job("slow", "import signal; signal.pause()", replicas=1, activeDeadlineSeconds=1)
    out = run(
        [str(write(tmp_path, job)), "--json", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == cli.EXIT_FAILED
    final = json_lines(out.stdout)[-1]
    assert (final["phase"], final["reason"]) == ("Failed", "DeadlineExceeded")


READY_THEN_WAIT = """
import os, signal
print("ready pid=%d" % os.getpid(), flush=True)
signal.pause()
"""


@pytest.mark.parametrize(
    "sig,code", [(signal.SIGINT, cli.EXIT_INTERRUPTED), (signal.SIGTERM, 128 + signal.SIGTERM)]
)
def test_ctrl_c_or_sigterm_stops_every_replica_and_reports_it(tmp_path, sig, code):
    path = write(tmp_path, command_job("stopme", READY_THEN_WAIT))
    p = subprocess.Popen(
        [*RUN, str(path), "--json", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = []
    try:
        for line in p.stderr:  # wait until both replicas say they are up
            if "ready pid=" in line:
                pids.append(int(line.rsplit("=", 1)[1]))
                if len(pids) == 2:
                    break
        p.send_signal(sig)
        stdout, _ = p.communicate(timeout=30)
    finally:  # a runner that does not stop fails this test, not the next one's warnings
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == code
    final = json_lines(stdout)[-1]
    assert final["phase"] == "Failed"
    assert (final["reason"], final["message"]) == (
        "Stopped",
        f"stopped by {signal.Signals(sig).name}",
    )
    assert set(final["exit_codes"].values()) == {128 + signal.SIGTERM}
    for pid in pids:  # no orphans left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- restart semantics: the operator's fold, carried out with processes --------------------------

#: Worker 1 counts its attempts in the run dir (the replicas' working directory) and fails
#: retryably (138, the trainer's "peer lost") on the first two; on the third it tells worker 0
#: through a FIFO. Worker 0 blocks on that FIFO until then (a gang restart stops it there), so
#: its success depends on worker 1's and not on which process starts first.
FLAKY_TWICE = """
import json, os, sys
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
    with open("ok") as fifo:
        sys.exit(0 if fifo.read() == "ok" else 1)
attempt = int(open("attempts").read()) + 1 if os.path.exists("attempts") else 1
open("attempts", "w").write(str(attempt))
if attempt <= 2:
    sys.exit(138)
with open("ok", "w") as fifo:
    fifo.write("ok")
"""


def test_retryable_exits_restart_the_failed_process_in_place_until_it_succeeds(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "ok")
    out = run(
        [
            str(write(tmp_path, command_job("flaky", FLAKY_TWICE, backoffLimit=2))),
            "--json",
            "--run-dir",
            str(run_dir),
            "--grace-period",
            "5",
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == cli.EXIT_SUCCEEDED, out.stdout + out.stderr
    events = json_lines(out.stdout)
    restarting = [e for e in events if e.get("reason") == "TrainingJobRestarting"]
    assert [e["restarts"] for e in restarting] == [1, 2]
    assert all("pod flaky-worker-1 failed with exit code 138" in e["message"] for e in restarting)
    # In place: worker 1 alone starts again; worker 0, blocked on the FIFO, is never touched.
    started = [(e["replica"], e["restarts"]) for e in events if e["event"] == "started"]
    assert sorted(started) == [("worker-0", 0), ("worker-1", 0), ("worker-1", 1), ("worker-1", 2)]
    assert all("restarting in place" in e["message"] for e in restarting)
    final = events[-1]
    assert (final["phase"], final["restarts"]) == ("Succeeded", 2)
    assert final["exit_codes"] == {"worker-0": 0, "worker-1": 0}
    assert (run_dir / "attempts").read_text() == "3"


@pytest.mark.parametrize("policy", ["Never", "ExitCode"])
def test_which_exit_codes_fail_the_job_at_once_depends_on_the_restart_policy(tmp_path, policy):
    """Never: any failure is final. ExitCode: 1-127 is final (a retryable 138 would restart)."""
    code = 138 if policy == "Never" else 2
    worker = (
        f"import sys, signal, json, os\n"
        f"if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1: sys.exit({code})\n"
        f"signal.pause()"
    )
    out = run(
        [
            str(write(tmp_path, command_job("final", worker, restart_policy=policy))),
            "--json",
            "--run-dir",
            str(tmp_path / "run"),
            "--grace-period",
            "5",
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == cli.EXIT_FAILED
    final = json_lines(out.stdout)[-1]
    assert (final["phase"], final["reason"], final["restarts"]) == (
        "Failed",
        "TrainingJobFailed",
        0,
    )
    assert final["message"] == (
        f"pod final-worker-1 failed with exit code {code}: permanent under restartPolicy {policy}"
    )


CHECKPOINT_EVERY = 5


#: long enough that, on a loaded machine, worker 1 is still training when the kill lands
KILL_JOB_STEPS = 200


def kill_worker_1_after_a_checkpoint(tmp_path: Path, **run_policy):
    """Run a 2-worker training job and SIGKILL worker 1 once the chief has saved a checkpoint.

    The pid comes from the runner's ``started`` event; the runner prints a progress line at least
    every 0.2 s (``--progress-interval 0``), so reading its stdout paces the checks of the
    checkpoint directory without any sleep. Returns (exit code, events, checkpoint step at the
    kill).
    """
    job = tiny_job(
        "resume",
        steps=KILL_JOB_STEPS,
        batchSize=64,
        evalEvery=0,
        checkpoint={"everySteps": CHECKPOINT_EVERY},
    )
    job["spec"]["runPolicy"] = run_policy
    run_dir = tmp_path / "run"
    with (
        open(tmp_path / "replicas.log", "w") as logs,
        subprocess.Popen(
            [
                *RUN,
                str(write(tmp_path, job)),
                "--json",
                "--run-dir",
                str(run_dir),
                "--progress-interval",
                "0",
                "--grace-period",
                "5",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=logs,
            text=True,
        ) as p,
    ):
        events, pid, killed_at = [], None, None
        for line in p.stdout:
            events.append(e := json.loads(line))
            if e["event"] == "started" and e["replica"] == "worker-1" and pid is None:
                pid = e["pid"]
            if pid is not None and killed_at is None:
                saved = sorted((run_dir / "checkpoints").glob("ckpt-*.json"))
                if saved:
                    killed_at = json.loads(saved[-1].read_text())["step"]
                    os.kill(pid, signal.SIGKILL)
        p.wait(timeout=120)
    assert killed_at is not None, (
        "worker 1 was never killed: " + (tmp_path / "replicas.log").read_text()[-3000:]
    )
    assert killed_at < KILL_JOB_STEPS, "the job finished before worker 1 could be killed mid-run"
    return p.returncode, events, killed_at


def test_a_sigkilled_worker_restarts_in_place_and_the_chief_resumes_from_its_checkpoint(tmp_path):
    """Worker 1 is restarted in place; worker 0 (the chief) leaves the broken ring and rejoins
    it in its own process (a re-exec: no restart, nothing counted), resuming from the
    checkpoints in its own directory. One failure, one restart."""
    code, events, killed_at = kill_worker_1_after_a_checkpoint(tmp_path, backoffLimit=6)
    assert code == cli.EXIT_SUCCEEDED, events[-1]
    restarts = [e for e in events if e.get("reason") == "TrainingJobRestarting"]
    assert restarts and all(
        "restarting in place, its peers rejoin the ring" in e["message"]
        and e["phase"] == "Restarting"
        for e in restarts
    )
    assert "pod resume-worker-1 failed with exit code 137" in restarts[0]["message"]
    started = [i for i, e in enumerate(events) if e["event"] == "started"]
    replicas = [events[i]["replica"] for i in started]
    assert replicas == ["worker-0", "worker-1", "worker-1"], "worker-1 alone restarted"
    assert not [e for e in events if e.get("reason") == "PodDeleted"]
    logs = (tmp_path / "replicas.log").read_text()
    assert re.search(
        r"worker-0.*rejoining the ring in place \(rejoin 1 of this container\)", logs
    ), logs[-3000:]
    again = started[-1]  # the chief's last progress from before the kill may be shown again
    stale = [e["step"] for e in events[:again] if e["event"] == "progress"][-1]
    first_step = next(
        e["step"]
        for e in events[again:]
        if e["event"] == "progress" and e["step"] and e["step"] != stale
    )
    assert first_step > killed_at >= CHECKPOINT_EVERY, "the chief resumed from its checkpoint"
    final = events[-1]
    assert (final["phase"], final["steps"]) == ("Succeeded", KILL_JOB_STEPS)
    assert final["restarts"] == 1, "the one restart in place counted, the rejoin not"
    assert final["exit_codes"] == {"worker-0": 0, "worker-1": 0}


def test_with_backoff_limit_0_a_sigkilled_worker_fails_the_job(tmp_path):
    code, events, _ = kill_worker_1_after_a_checkpoint(tmp_path, backoffLimit=0)
    assert code == cli.EXIT_FAILED
    final = events[-1]
    assert (final["phase"], final["reason"], final["restarts"]) == (
        "Failed",
        "BackoffLimitExceeded",
        0,
    )
    assert "restarts reached backoffLimit=0" in final["message"]
    assert not [e for e in events if e["event"] == "started" and e["restarts"] > 0]


# ---- the evaluator role, export and data volumes -------------------------------------------------


def test_a_host_path_volume_is_the_local_path_itself_and_is_never_created(tmp_path):
    data = tmp_path / "mydata"
    obj = tiny_job(
        dataset="fashion-mnist", data={"volume": {"hostPath": {"path": str(data)}}, "file": "d.npz"}
    )
    _, replicas = plan.plan(obj, tmp_path / "run")
    argv = list(replicas[0].argv)
    assert argv[argv.index("--data") + 1] == str(data / "d.npz")
    assert not any(d == str(data) or d.startswith(str(data) + "/") for d in replicas[0].dirs)


def test_the_evaluator_example_evaluates_every_checkpoint_and_exports_a_keras_model(tmp_path):
    """examples/evaluator.yaml as local processes: the evaluator evaluates steps 10, 20 and 30
    and exits 0; the chief's export loads with read_keras; the summary names both."""
    from ringtrain_trainer.export import read_keras

    proc = subprocess.run(
        [*RUN, str(ROOT / "examples" / "evaluator.yaml"), "--json", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["phase"] == "Succeeded"
    assert final["exit_codes"] == {"chief-0": 0, "worker-0": 0, "evaluator-0": 0}
    assert [e["step"] for e in final["evaluations"]] == [10, 20, 30]
    assert final["evaluations"][-1]["test_accuracy"] == final["test_accuracy"]
    assert final["export"] == str(tmp_path / "checkpoints" / "model.keras")
    config, weights = read_keras(final["export"])
    assert config["class_name"] == "Sequential" and len(weights) == 6
    assert "evaluator-0| checkpoint step 30  test loss" in proc.stderr


def test_a_replicas_stray_non_utf8_byte_is_logged_replaced_and_the_run_succeeds(tmp_path):
    """Before (issue 35): a replica's byte that is not UTF-8 ended the runner's reader thread
    with a traceback, and the run never saw the replica's end."""
    code = "import sys; sys.stdout.buffer.write(b'bad \\xff byte\\n'); sys.stdout.flush()"
    run_dir = tmp_path / "run"
    out = run(
        [
            str(write(tmp_path, command_job("bytes", code, replicas=1))),
            "--json",
            "--run-dir",
            str(run_dir),
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == cli.EXIT_SUCCEEDED, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "bad \ufffd byte" in (run_dir / "pods" / "bytes-worker-0" / "log").read_text()
