"""The error hierarchy's one format for where a ring failed, and TF_CONFIG errors inside it."""

import pickle

import pytest

from ringtrain import cluster
from ringtrain.errors import (
    EXIT_PERMANENT,
    EXIT_RETRYABLE,
    InvalidSpec,
    PeerTimeout,
    RingError,
    RingtrainError,
    Unauthenticated,
    exit_code_for,
)


def test_rank_step_and_peer_lead_the_message_and_stay_attributes():
    e = PeerTimeout("no data for 30 s", rank=1, step=7, peer="10.0.0.2:2222")
    assert str(e) == "rank 1 step 7 peer 10.0.0.2:2222: no data for 30 s"
    assert (e.rank, e.step, e.peer, e.reason) == (1, 7, "10.0.0.2:2222", "no data for 30 s")
    assert isinstance(e, RingError) and exit_code_for(e) == EXIT_RETRYABLE


def test_unknown_parts_are_left_out_and_step_minus_one_is_kept():
    assert (
        str(Unauthenticated("w-1:2222 refused the connection", rank=0))
        == "rank 0: w-1:2222 refused the connection"
    )
    assert (
        str(RingError("cannot listen", rank=2, step=-1, peer="h:1"))
        == "rank 2 step -1 peer h:1: cannot listen"
    )
    assert str(RingError("plain")) == "plain"
    assert RingError("plain").rank is None
    assert exit_code_for(Unauthenticated("x", rank=0)) == EXIT_PERMANENT


def test_ring_errors_survive_pickling_with_their_message():
    e = pickle.loads(pickle.dumps(RingError("lost", rank=1, step=3, peer="h:1")))
    assert str(e) == "rank 1 step 3 peer h:1: lost"


def test_a_bad_tf_config_is_an_invalid_spec_with_the_permanent_exit_code():
    with pytest.raises(InvalidSpec, match="TF_CONFIG is not valid JSON") as e:
        cluster.parse("{")
    assert isinstance(e.value, cluster.InvalidClusterSpec)
    assert isinstance(e.value, (RingtrainError, ValueError))  # old callers caught ValueError
    assert exit_code_for(e.value) == EXIT_PERMANENT


@pytest.mark.parametrize(
    "address, parsed",
    [
        ("w-0.job:2222", ("w-0.job", 2222)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("[::1]:2222", ("::1", 2222)),
    ],
)
def test_split_address_is_part_of_the_cluster_contract(address, parsed):
    assert cluster.split_address(address) == parsed
