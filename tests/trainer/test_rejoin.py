"""When a survivor rejoins in its container instead of exiting (ringtrain_trainer.rejoin); the
real re-exec is tests/trainer/test_trainer_worker_ring.py's and the cluster's test_faults.py's."""

import pytest

from ringtrain.errors import CheckpointError, PeerTimeout, RingError, Unauthenticated
from ringtrain_trainer import rejoin
from ringtrain_trainer.rejoin import Rejoins, decide

LOST = RingError("connection closed by peer", rank=0, step=7)


def test_a_peer_lost_after_the_ring_formed_rejoins_and_counts():
    assert decide(LOST, ring_formed=True, step=7, limit=3, previous=Rejoins()) == Rejoins(1, 1, 7)
    assert decide(
        PeerTimeout("silent"), ring_formed=True, step=7, limit=3, previous=Rejoins()
    ) == Rejoins(1, 1, 7)


def test_a_failure_while_the_ring_forms_rejoins_but_a_deadline_that_passed_does_not():
    """A peer restarting at the same moment (a stale key, its predecessor's abort): rejoin.
    A peer that never came within the connect timeout: exit, for the kubelet to count."""
    assert decide(LOST, ring_formed=False, step=None, limit=3, previous=Rejoins()) == Rejoins(
        1, 1, -1
    )
    assert (
        decide(
            PeerTimeout("worker-1 did not answer within 120 s"),
            ring_formed=False,
            step=None,
            limit=3,
            previous=Rejoins(),
        )
        is None
    )


@pytest.mark.parametrize(
    "error, formed, step",
    [
        (Unauthenticated("wrong token"), True, 3),  # permanent
        (CheckpointError("corrupt"), True, 3),  # not the ring's
        (ValueError("a bug"), True, 3),
    ],
)
def test_everything_else_exits(error, formed, step):
    assert decide(error, ring_formed=formed, step=step, limit=3, previous=Rejoins()) is None


def test_rejoins_in_a_row_without_a_step_are_bounded_and_progress_resets_the_streak():
    r = Rejoins()
    for n in (1, 2, 3):
        r = decide(LOST, ring_formed=True, step=40, limit=3, previous=r)
        assert (r.total, r.streak) == (n, n)
    assert decide(LOST, ring_formed=True, step=40, limit=3, previous=r) is None
    r = decide(LOST, ring_formed=True, step=41, limit=3, previous=r)  # one step made
    assert (r.total, r.streak, r.step) == (4, 1, 41)
    assert decide(LOST, ring_formed=True, step=7, limit=0, previous=Rejoins()) is None


@pytest.mark.parametrize(
    "value, want",
    [
        (None, Rejoins()),
        ("", Rejoins()),
        ("garbage", Rejoins()),
        ("1,2", Rejoins()),
        ("3,1,40", Rejoins(3, 1, 40)),
        ("-5,-1,-1", Rejoins(0, 0, -1)),
    ],
)
def test_the_count_travels_in_the_environment(value, want):
    env = {} if value is None else {rejoin.ENV: value}
    assert Rejoins.from_env(env) == want
