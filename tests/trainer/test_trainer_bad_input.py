"""Malformed TF_CONFIG values and ring settings: ``ringtrain worker`` exits with the permanent
code (2) and names what is wrong, before it opens a port or reads a byte of data.

The bulk runs ``TrainerConfig.from_args`` in process; a few run the real ``ringtrain worker``."""

from __future__ import annotations

import json
import subprocess

import pytest
from support.procs import WORKER, without_cluster

from ringtrain.errors import EXIT_PERMANENT, InvalidSpec
from ringtrain_trainer.config import TrainerConfig

RING = {
    "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
    "task": {"type": "worker", "index": 0},
}
GOOD_ENV = {"TF_CONFIG": json.dumps(RING), "RINGTRAIN_TOKEN": "t"}


def tf(**kw) -> dict:
    return {"TF_CONFIG": json.dumps({**RING, **kw}), "RINGTRAIN_TOKEN": "t"}


#: (env, extra flags, what the message must name)
CASES = {
    "not json": ({"TF_CONFIG": "{cluster:"}, [], "TF_CONFIG is not valid JSON"),
    "nul byte": ({"TF_CONFIG": "\x00"}, [], "TF_CONFIG is not valid JSON"),
    "deep nesting": ({"TF_CONFIG": "[" * 100000}, [], "TF_CONFIG"),
    "a list": ({"TF_CONFIG": "[]"}, [], "TF_CONFIG must be a JSON object"),
    "cluster a string": (tf(cluster="w:1"), [], "TF_CONFIG.cluster"),
    "unknown role": (tf(cluster={"gpu": ["a:1"]}), [], "TF_CONFIG.cluster.gpu"),
    "address without port": (
        tf(cluster={"worker": ["a", "b:1"]}),
        [],
        "TF_CONFIG.cluster.worker[0]",
    ),
    "port 0": (tf(cluster={"worker": ["a:0", "b:1"]}), [], "TF_CONFIG.cluster.worker[0]"),
    "port too big": (tf(cluster={"worker": ["a:1", "b:65536"]}), [], "TF_CONFIG.cluster.worker[1]"),
    "address a number": (tf(cluster={"worker": [2222]}), [], "TF_CONFIG.cluster.worker"),
    "duplicate address": (
        tf(cluster={"worker": ["a:1", "a:1"]}),
        [],
        "TF_CONFIG.cluster.worker[1]",
    ),
    "duplicate across roles": (
        tf(cluster={"chief": ["a:1"], "worker": ["a:1"]}),
        [],
        "TF_CONFIG.cluster.worker[0]",
    ),
    "two chiefs": (
        tf(cluster={"chief": ["a:1", "b:1"], "worker": ["c:1"]}),
        [],
        "TF_CONFIG.cluster.chief",
    ),
    "task missing": (
        {"TF_CONFIG": json.dumps({"cluster": RING["cluster"]})},
        [],
        "TF_CONFIG.task.type",
    ),
    "task type unknown": (tf(task={"type": "boss", "index": 0}), [], "TF_CONFIG.task.type"),
    "index out of range": (tf(task={"type": "worker", "index": 2}), [], "TF_CONFIG.task.index"),
    "index negative": (tf(task={"type": "worker", "index": -1}), [], "TF_CONFIG.task.index"),
    "index a bool": (tf(task={"type": "worker", "index": True}), [], "TF_CONFIG.task.index"),
    "index huge": (tf(task={"type": "worker", "index": 10**30}), [], "TF_CONFIG.task.index"),
    "environment a number": (tf(environment=3), [], "TF_CONFIG.environment"),
    "no token in a ring": ({"TF_CONFIG": json.dumps(RING)}, [], "RINGTRAIN_TOKEN"),
    "empty token in a ring": ({**GOOD_ENV, "RINGTRAIN_TOKEN": ""}, [], "RINGTRAIN_TOKEN"),
    "unreadable token file": (
        {"TF_CONFIG": json.dumps(RING), "RINGTRAIN_TOKEN_FILE": "/nonexistent/token"},
        [],
        "RINGTRAIN_TOKEN_FILE",
    ),
    "step timeout negative": (GOOD_ENV, ["--ring-step-timeout-s", "-1"], "--ring-step-timeout-s"),
    "step timeout zero": (GOOD_ENV, ["--ring-step-timeout-s", "0"], "--ring-step-timeout-s"),
    "step timeout nan": (GOOD_ENV, ["--ring-step-timeout-s", "nan"], "--ring-step-timeout-s"),
    "step timeout inf": (GOOD_ENV, ["--ring-step-timeout-s", "inf"], "--ring-step-timeout-s"),
    "connect timeout 1e400": (
        GOOD_ENV,
        ["--ring-connect-timeout-s", "1e400"],
        "--ring-connect-timeout-s",
    ),
    "bucket zero": (GOOD_ENV, ["--bucket-mb", "0"], "--bucket-mb"),
    "bucket nan": (GOOD_ENV, ["--bucket-mb", "nan"], "--bucket-mb"),
    "metrics port negative": (GOOD_ENV, ["--metrics-port", "-1"], "--metrics-port"),
    "metrics port too big": (GOOD_ENV, ["--metrics-port", "70000"], "--metrics-port"),
}


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_bad_tf_config_or_ring_setting_is_refused_naming_the_field(case):
    env, flags, field = CASES[case]
    with pytest.raises(InvalidSpec) as e:
        TrainerConfig.from_args(["--steps", "1", *flags], env=env)
    assert field in str(e.value) and e.value.exit_code == EXIT_PERMANENT


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--ring-transport", "udp"], "--ring-transport"),
        (["--ring-step-timeout-s", "soon"], "--ring-step-timeout-s"),
    ],
)
def test_unparsable_ring_flags_exit_2_naming_the_flag(flags, field, capsys):
    with pytest.raises(SystemExit) as e:
        TrainerConfig.from_args(["--steps", "1", *flags], env=GOOD_ENV)
    assert e.value.code == EXIT_PERMANENT and field in capsys.readouterr().err


def test_a_one_member_ring_needs_no_token():
    one = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    assert TrainerConfig.from_args(["--steps", "1"], env={"TF_CONFIG": json.dumps(one)})


PROCESS_CASES = [
    "not json",
    "duplicate address",
    "no token in a ring",
    "step timeout inf",
    "metrics port too big",
]


@pytest.mark.parametrize("case", PROCESS_CASES)
def test_the_real_worker_exits_2_and_names_the_field(tmp_path, case):
    env, flags, field = CASES[case]
    log = tmp_path / "termination.json"
    base = without_cluster()
    p = subprocess.run(
        [
            *WORKER,
            "--steps",
            "1",
            "--dataset",
            "mnist-5k",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--termination-log",
            str(log),
            *flags,
        ],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == EXIT_PERMANENT, p.stderr[-1000:]
    assert field in p.stderr
    reported = json.loads(log.read_text())
    assert reported["exit_code"] == EXIT_PERMANENT and field in reported["error"]
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
