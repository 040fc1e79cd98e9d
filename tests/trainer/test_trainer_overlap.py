"""The overlap figure is honest: waiting for a peer is exposed, not hidden, and a reducer that
does not overlap (``overlap=False``, ``--no-overlap-comm``) measures as hiding nothing.

Structural facts only (who started before backward ended, what was blocked), never tight
ratios: the machine is small and shared."""

import time

import numpy as np
import pytest

from ringtrain_trainer import optim as O
from ringtrain_trainer.collective import Collective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.reducer import Reducer, StepCommStats
from ringtrain_trainer.reducer.pipeline import hidden_seconds

SIZES = [100, 200, 300, 400]
PIECES = ((0, 100), (100, 300), (300, 600), (600, 1000))


class SlowCollective(Collective):
    """Size 2, but alone: each allreduce takes ``seconds``, either blocked on a (pretend)
    slower peer, as the ring reports it through ``peer_waits``, or busy (no wait)."""

    size = 2

    def __init__(self, seconds: float, blocked: bool):
        self.seconds, self.blocked = seconds, blocked
        self.starts: list[float] = []

    def allreduce_mean_(self, buf, step=0, tag=0):
        t0 = time.perf_counter()
        self.starts.append(t0)
        if self.blocked:
            time.sleep(self.seconds)
            if self.peer_waits is not None:
                self.peer_waits.append((t0, time.perf_counter()))
        else:
            while time.perf_counter() - t0 < self.seconds:
                pass

    def broadcast_(self, buf, root=0):
        pass


def one_step(col, overlap=True, backward_s=0.15):
    """One step whose 'backward' streams the first piece at once and then computes for
    ``backward_s``; returns the stats, the end of backward and the parameters."""
    p = np.zeros(1000, np.float32)
    r = Reducer(
        SIZES,
        col,
        O.build("sgd", p, O.StepDecay(1.0)),
        bucket_bytes=1200,
        first_bucket_bytes=400,
        overlap=overlap,
    )
    r.grads[:] = np.arange(1000, dtype=np.float32)
    r.begin_step(1)
    r.on_grad(*PIECES[0])
    time.sleep(backward_s)
    for piece in PIECES[1:]:
        r.on_grad(*piece)
    end = time.perf_counter()
    stats = r.finish()
    r.close()
    return stats, end, p


def test_waiting_for_a_peer_during_backward_is_exposed_not_hidden():
    col = SlowCollective(0.05, blocked=True)
    stats, end, _ = one_step(col)
    assert col.starts[0] < end  # bucket 0 ran while backward went on ...
    assert stats.lead_s > 0.05
    assert stats.allreduce_s > 0.1 and stats.peer_wait_s >= 0.95 * stats.allreduce_s
    assert stats.hidden_s < 0.05 * stats.allreduce_s  # ... but it only waited: nothing hidden
    assert stats.overlap_fraction < 0.05


def test_work_done_during_backward_is_hidden():
    col = SlowCollective(0.05, blocked=False)
    stats, end, _ = one_step(col)
    assert col.starts[0] < end and stats.peer_wait_s == 0
    assert stats.hidden_s >= 0.04  # bucket 0's 50 ms of work fell inside the 150 ms backward


def test_serialized_reducer_starts_nothing_before_backward_ends_and_hides_nothing():
    col = SlowCollective(0.02, blocked=False)
    stats, end, p_serial = one_step(col, overlap=False)
    assert len(col.starts) == 3 and min(col.starts) >= end
    assert stats.hidden_s == 0 and stats.lead_s == 0 and stats.allreduce_s > 0.05
    assert stats.exposed_wait_s >= stats.allreduce_s
    _, _, p_overlap = one_step(SlowCollective(0.0, blocked=False))
    np.testing.assert_array_equal(p_serial, p_overlap)  # same update, only later


def test_hidden_seconds_clips_at_backward_and_removes_blocked_spans():
    assert hidden_seconds([(0, 4), (5, 9)], [], 6) == 5
    assert hidden_seconds([(0, 4), (5, 9)], [(1, 3), (5, 8)], 6) == 2
    assert hidden_seconds([(7, 9)], [(7, 8)], 6) == 0
    total = StepCommStats(1, 0.5, 0.1, 8, 0.2, 0.3) + StepCommStats(1, 0.5, 0.1, 8, 0.2, 0.3)
    assert total == StepCommStats(2, 1.0, 0.2, 16, 0.4, 0.6)
    # field by field, each to its own (the bench sums one per step)
    added = StepCommStats(1, 2, 3, 4, 5, 6) + StepCommStats(10, 20, 30, 40, 50, 60)
    assert added == StepCommStats(11, 22, 33, 44, 55, 66)


@pytest.mark.parametrize("argv, overlap", [([], True), (["--no-overlap-comm"], False)])
def test_the_worker_flag_switches_the_reducer(argv, overlap, mnist5k):
    from ringtrain_trainer.worker import Trainer

    cfg = TrainerConfig.from_args([*argv, "--dataset", "mnist-5k", "--termination-log", ""])
    assert cfg.overlap_comm is overlap
    t = Trainer(cfg, SlowCollective(0.0, blocked=False), mnist5k)
    try:
        assert t.reducer.overlap is overlap
        _, _, comm = t.train_one_step()
        if not overlap:
            assert comm.hidden_s == 0 and comm.lead_s == 0
    finally:
        t.close()
