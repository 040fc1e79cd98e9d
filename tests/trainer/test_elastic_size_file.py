"""An elastic job's size file (``ringtrain_trainer.elastic``, decision 0217): it wins over the
pod's TF_CONFIG and ``--batch-size`` at start-up, and a change to it stops the ring for a resize."""

from __future__ import annotations

import json
import threading

import pytest

from ringtrain import cluster
from ringtrain.errors import InvalidSpec
from ringtrain_trainer import elastic
from ringtrain_trainer.config import TrainerConfig


def tf_config(n: int, index: int) -> str:
    return cluster.build({"worker": [f"w{i}:2222" for i in range(n)]}, "worker", index)


def write(path, n: int, index: int = 0, batch: int = 80) -> str:
    raw = json.dumps({"workers": n, "batchSize": batch, "tfConfig": tf_config(n, index)})
    path.write_text(raw)
    return raw


def test_the_size_file_wins_over_the_environment_and_the_flag(tmp_path):
    f = tmp_path / "size.json"
    raw = write(f, 3, index=1)
    env = {"TF_CONFIG": tf_config(2, 1), elastic.ENV: str(f), "RINGTRAIN_TOKEN": "t"}
    cfg = TrainerConfig.from_args(["--batch-size", "120", "--steps", "5"], env)
    assert (cfg.batch_size, cfg.cluster.world_size, cfg.cluster.task_index) == (80, 3, 1)
    assert (cfg.elastic_file, cfg.elastic_size) == (str(f), raw)
    plain = TrainerConfig.from_args(["--batch-size", "120"], {"TF_CONFIG": tf_config(1, 0)})
    assert (plain.batch_size, plain.elastic_file) == (120, None)


@pytest.mark.parametrize(
    "content", ["", "{}", '{"workers": 0, "batchSize": 1, "tfConfig": "{}"}', "not json"]
)
def test_a_bad_size_file_is_refused_naming_it(tmp_path, content):
    f = tmp_path / "size.json"
    f.write_text(content)
    with pytest.raises(InvalidSpec, match=f"{elastic.ENV} {f}"):
        TrainerConfig.from_args([], {elastic.ENV: str(f)})
    with pytest.raises(InvalidSpec, match="cannot read"):
        TrainerConfig.from_args([], {elastic.ENV: str(tmp_path / "absent")})


def test_a_change_stops_the_ring_and_says_the_new_size(tmp_path):
    f = tmp_path / "size.json"
    started = write(f, 2)
    stop = threading.Event()
    w = elastic.Watcher(str(f), started)
    w.attach(stop)
    try:
        assert not stop.wait(3 * elastic.POLL_S)  # the same content is no change
        write(f, 3)
        assert stop.wait(10)
        size = w.after_stop(signalled=False)
        assert size is not None and (size.workers, size.batch_size) == (3, 80)
        assert w.seen_at > 0
    finally:
        w.close()


def test_after_a_stop_it_did_not_ask_for_a_worker_waits_for_its_file_a_signalled_one_not(tmp_path):
    f = tmp_path / "size.json"
    started = write(f, 2)
    w = elastic.Watcher(str(f), started)
    try:
        assert w.after_stop(signalled=True) is None  # told to stop: no waiting
        assert w.after_stop(signalled=False, settle_s=2 * elastic.POLL_S) is None  # no change
        threading.Timer(elastic.POLL_S, write, (f, 1)).start()
        size = w.after_stop(signalled=False, settle_s=10)  # a peer's vote came first
        assert size is not None and size.workers == 1
    finally:
        w.close()


def test_a_reexecuted_worker_reads_what_it_was_told():
    r = elastic.Resized.from_env({elastic.RESIZED_ENV: "2,3,84,100.5"})
    assert r == elastic.Resized(2, 3, 84, 100.5)
    assert r.event(103.0, 84) == {
        "event": "resized",
        "from": 2,
        "to": 3,
        "step": 84,
        "ring_formed_s": 2.5,
    }
    assert elastic.Resized.from_env({}) is None
    assert elastic.Resized.from_env({elastic.RESIZED_ENV: "junk"}) is None
