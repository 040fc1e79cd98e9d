"""`ringtrain worker` in a gang: the --ring-* flags, the shared evaluation, and the termination
log under mpirun — each with real worker processes (ring over loopback, or a real mpirun)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from support import procs as procs_mod
from support.ports import free_port, loopback_addresses
from support.reference import single_worker_run

from ringtrain import cluster
from ringtrain.errors import EXIT_RETRYABLE, InvalidSpec
from ringtrain_trainer import worker_main
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig

WORKER = [*procs_mod.WORKER, "--dataset", "mnist-5k", "--json"]


def start_worker(
    r: int, addresses: list[str], token: str, argv: list[str], tmp_path
) -> subprocess.Popen:
    """Rank ``r`` of the job on ``addresses``, a real process with its own termination log."""
    command = [*WORKER, *argv, "--termination-log", str(tmp_path / f"log-{r}")]
    return procs_mod.start_member(command, addresses, r, token)


def start_gang(n: int, argv: list[str], tmp_path) -> list[subprocess.Popen]:
    """n real worker processes of one job on loopback, each with its own termination log."""
    addresses, token = loopback_addresses(n), procs_mod.new_token()
    return [start_worker(r, addresses, token, argv, tmp_path) for r in range(n)]


def test_ring_flags_reach_the_config_and_bad_values_are_refused():
    cfg = TrainerConfig.from_args(
        [
            "--ring-transport",
            "grpc",
            "--ring-step-timeout-s",
            "90",
            "--ring-connect-timeout-s",
            "5",
        ],
        {},
    )
    assert (cfg.ring_transport, cfg.ring_step_timeout_s, cfg.ring_connect_timeout_s) == (
        "grpc",
        90.0,
        5.0,
    )
    assert TrainerConfig.from_args([], {}).ring_transport == "grpc+tcp"
    assert TrainerConfig.from_args(["--ring-transport", "tcp"], {}).ring_transport == "tcp"
    for flag in ("--ring-step-timeout-s", "--ring-connect-timeout-s"):
        with pytest.raises(InvalidSpec, match=flag):
            TrainerConfig.from_args([flag, "0"], {})


def test_the_worker_hands_its_ring_flags_to_ring_connect(monkeypatch):
    from ringtrain_trainer import ring

    seen = {}
    monkeypatch.setattr(ring, "connect", lambda spec, token, **kw: seen.update(kw) or "ring")
    env = {
        "RINGTRAIN_TOKEN": "t",
        "TF_CONFIG": cluster.build({"worker": ["a:1", "b:2"]}, "worker", 0),
    }
    cfg = TrainerConfig.from_args(
        [
            "--ring-transport",
            "grpc",
            "--ring-step-timeout-s",
            "7",
            "--ring-connect-timeout-s",
            "9",
            "--ring-health-timeout-s",
            "4",
            "--ring-stall-warning-s",
            "11",
            "--ring-min-bytes-per-s",
            "5000",
            "--no-ring-shared-memory",
        ],
        env,
    )
    assert worker_main.connect(cfg) == "ring"
    assert seen == {
        "transport": "grpc",
        "step_timeout_s": 7.0,
        "connect_timeout_s": 9.0,
        "health_timeout_s": 4.0,
        "stall_s": 11.0,
        "min_bytes_per_s": 5000.0,
        "observer": None,
        "tls": None,
        "encrypt_data": False,
        "health_port": 0,
        "shared_memory": False,
        "elastic": False,  # no elastic size file (RINGTRAIN_ELASTIC_FILE)
        "resized": None,
    }


def test_tls_material_comes_from_the_env_or_the_flag_and_its_absence_is_said(
    monkeypatch, tmp_path, capsys
):
    from ringtrain import pki
    from ringtrain_trainer import ring
    from ringtrain_trainer.ring.tls import INSECURE_NOTE

    m = pki.create("j", "ns", "j")
    for name, content in m.files().items():
        (tmp_path / name).write_bytes(content)
    seen = {}
    monkeypatch.setattr(ring, "connect", lambda spec, token, **kw: seen.update(kw) or "ring")
    env = {
        "RINGTRAIN_TOKEN": "t",
        "TF_CONFIG": cluster.build({"worker": ["a:1", "b:2"]}, "worker", 0),
    }
    cfg = TrainerConfig.from_args(
        ["--ring-encrypt-data"], {**env, "RINGTRAIN_TLS_DIR": str(tmp_path)}
    )
    assert "PRIVATE" not in repr(cfg)
    worker_main.connect(cfg)
    assert (seen["tls"], seen["encrypt_data"]) == (m, True)
    assert INSECURE_NOTE not in capsys.readouterr().err
    flag = TrainerConfig.from_args(
        ["--ring-tls-dir", str(tmp_path)], {**env, "RINGTRAIN_TLS_DIR": "/nowhere"}
    )
    assert flag.tls == m
    worker_main.connect(TrainerConfig.from_args([], env))
    assert seen["tls"] is None and INSECURE_NOTE in capsys.readouterr().err
    (tmp_path / "tls.crt").unlink()
    with pytest.raises(InvalidSpec, match=r"tls\.crt"):
        TrainerConfig.from_args([], {**env, "RINGTRAIN_TLS_DIR": str(tmp_path)})


@pytest.mark.timeout(180)
def test_two_workers_evaluate_together_and_match_one_worker_with_twice_the_batch(tmp_path):
    """Each worker evaluates half the test set and the counts are summed over the ring: the
    chief's accuracy is the one a single worker with the global batch computes on its own."""
    procs = start_gang(2, ["--steps", "6", "--batch-size", "8", "--eval-every", "3"], tmp_path)
    outs = [p.communicate(timeout=170) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    chief = [json.loads(line) for line in outs[0][0].splitlines()]
    evals = [e["test_accuracy"] for e in chief if e["event"] == "eval"]
    single = single_worker_run(
        TrainerConfig(dataset="mnist-5k", steps=6, batch_size=16, eval_every=3)
    )
    assert len(evals) == 2 and evals[-1] == pytest.approx(single.test_accuracy, abs=2e-3)
    assert json.loads((tmp_path / "log-0").read_text())["test_accuracy"] == evals[-1]
    logs = [json.loads((tmp_path / f"log-{r}").read_text()) for r in (0, 1)]
    assert logs[1]["rank"] == 1  # one log per pod
    # the workers end with the same weights, and say so: the digest of their own parameters
    assert logs[0]["params_sha256"] == logs[1]["params_sha256"]
    assert len(logs[0]["params_sha256"]) == 64


HEAD_START_S = 20.0  # the figure: a worker that starts 20 s before its peers


@pytest.mark.timeout(240)
def test_a_worker_started_20_s_before_its_peers_waits_names_them_and_trains_once_they_come(
    tmp_path,
):
    """Worker 0 alone for 20 s: it does not crash or give up, its /status names worker-1 and
    worker-2 the whole time and its log says whom it waits for; then they come, and the job
    trains to the end with the same weights on all three."""
    from ringtrain import events

    addresses, token, port = loopback_addresses(3), procs_mod.new_token(), free_port()
    argv = ["--steps", "4", "--batch-size", "8", "--ring-connect-timeout-s", "90"]
    procs = [start_worker(0, addresses, token, [*argv, "--metrics-port", str(port)], tmp_path)]
    started = time.monotonic()
    try:
        seen: list = []
        while time.monotonic() - started < HEAD_START_S:  # the deliberate head start
            assert procs[0].poll() is None, procs[0].communicate()[1][-2000:]
            st = events.fetch_status(f"http://127.0.0.1:{port}/status", timeout_s=2)
            if st is not None and (st.waiting_for or seen):
                seen.append(st.waiting_for)
            time.sleep(0.5)  # sampling /status while the head start runs out
        assert seen and all(w == ["worker-1", "worker-2"] for w in seen), seen
        assert time.monotonic() - started >= HEAD_START_S
        procs += [start_worker(r, addresses, token, argv, tmp_path) for r in (1, 2)]
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        procs_mod.kill(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    assert "rank 0: waiting for worker-1, worker-2" in outs[0][1]
    assert "rank 0: all 3 ranks answered" in outs[0][1]
    logs = [json.loads((tmp_path / f"log-{r}").read_text()) for r in range(3)]
    assert [log["steps"] for log in logs] == [4, 4, 4], logs
    assert len({log["params_sha256"] for log in logs}) == 1, logs


@pytest.mark.timeout(120)
def test_a_lost_peer_fails_the_step_within_the_step_timeout_flag(tmp_path):
    """With rejoins off, the survivor exits retryable, as every member did before rejoins."""
    procs = start_gang(
        2, ["--steps", "100000", "--ring-step-timeout-s", "2", "--ring-rejoin-limit", "0"], tmp_path
    )
    try:
        assert json.loads(procs[0].stdout.readline())["event"] == "progress"  # training
        procs[1].kill()
        killed = time.monotonic()
        assert procs[0].wait(timeout=60) == EXIT_RETRYABLE
        # the flag's 2 s (plus the engine's grace), far below the default 30 s
        assert time.monotonic() - killed < 20
    finally:
        procs_mod.kill(procs)


@pytest.mark.timeout(240)
def test_a_survivor_rejoins_in_its_own_process_and_the_result_is_unchanged(tmp_path):
    """Worker 1 is SIGKILLed mid-run and started again (as its kubelet would); the chief, its
    survivor, neither exits nor restarts: it re-executes itself (same PID), rejoins, resumes
    from its checkpoint, and the gang ends with the parameters of an undisturbed run."""

    def argv(run: str) -> list[str]:
        return [
            "--steps",
            "240",
            "--checkpoint-every",
            "20",
            "--checkpoint-dir",
            str(tmp_path / run / "ckpt"),
        ]

    for run in ("calm", "killed"):
        (tmp_path / run).mkdir()
    calm = start_gang(2, argv("calm"), tmp_path / "calm")
    outs = [p.communicate(timeout=200) for p in calm]
    assert [p.returncode for p in calm] == [0, 0], [e[-2000:] for _, e in outs]

    addresses, token = loopback_addresses(2), procs_mod.new_token()
    procs = [
        start_worker(r, addresses, token, argv("killed"), tmp_path / "killed") for r in range(2)
    ]
    try:
        chief = procs[0]
        while (step := json.loads(chief.stdout.readline()).get("step", 0)) < 50:
            pass  # the chief's own progress lines: it has committed checkpoints 20 and 40
        procs[1].kill()
        assert procs[1].communicate(timeout=30)[0] is not None and procs[1].returncode == -9
        procs.append(start_worker(1, addresses, token, argv("killed"), tmp_path / "killed"))
        out, err = chief.communicate(timeout=200)
        try:
            late = procs[2].communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            procs[2].kill()
            late = procs[2].communicate()[1]
        if (codes := (chief.returncode, procs[2].returncode)) != (0, 0):
            pytest.fail(f"exit codes {codes}\nCHIEF:\n{err[-4000:]}\nWORKER-1:\n{late[-4000:]}")
    finally:
        procs_mod.kill(procs)
    assert step >= 50
    assert "rejoining it in this container (exec, no restart; 1 of --ring-rejoin-limit 3" in err
    assert "rejoining the ring in place (rejoin 1 of this container)" in err
    resumed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "progress" for e in resumed), out[-2000:]
    digests = [
        json.loads((tmp_path / run / "log-0").read_text())["params_sha256"]
        for run in ("calm", "killed")
    ]
    assert digests[0] == digests[1]


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_under_mpirun_only_rank_0_writes_the_termination_log(tmp_path):
    log = tmp_path / "log"
    out = subprocess.run(
        [
            *procs_mod.mpirun(2),
            *WORKER,
            "--collective",
            "mpi",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--termination-log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # (stdout is not parsed: mpirun may interleave the two ranks' lines mid-line)
    final = json.loads(log.read_text())
    assert (final["rank"], final["world_size"], final["steps"]) == (0, 2, 3)


def test_the_termination_log_owner_is_every_pod_but_only_mpi_rank_0():
    """Which process writes: the rule itself, for ranks a two-process mpirun cannot pin down
    (there rank 0 might simply write last)."""
    ring = TrainerConfig()
    mpi = TrainerConfig(collective="mpi")
    rank1 = LocalCollective()
    rank1.rank = 1
    assert worker_main.own_termination_log("/log", ring, rank1) == "/log"
    assert worker_main.own_termination_log("/log", mpi, rank1) is None
    assert worker_main.own_termination_log("/log", mpi, LocalCollective()) == "/log"
