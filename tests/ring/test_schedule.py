"""Pure units of the chunk schedule, and the whole algorithm simulated in memory."""

from itertools import pairwise

import numpy as np
import pytest

from ringtrain_trainer.ring import schedule


@pytest.mark.parametrize("n,size", [(0, 1), (0, 3), (1, 4), (5, 3), (10, 4), (7, 7), (1001, 6)])
def test_segments_cover_buffer_and_differ_by_at_most_one(n, size):
    bounds = schedule.segment_bounds(n, size)
    assert len(bounds) == size
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= 1


def test_chunks_split_a_range_and_skip_empty_ones():
    assert schedule.chunks(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert schedule.chunks(4, 4, 3) == []
    with pytest.raises(ValueError, match="chunk size"):
        schedule.chunks(0, 1, 0)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_each_phase_sends_what_the_previous_one_received(size):
    for rank in range(size):
        phases = schedule.allreduce_phases(rank, size)
        assert len(phases) == 2 * (size - 1)
        assert all(nxt.send == cur.recv for cur, nxt in pairwise(phases))
        assert phases[size - 2].recv == (rank + 1) % size  # the segment it then owns in full
        # a rank receives from its left exactly what the left sends in the same phase
        left = schedule.allreduce_phases(schedule.left(rank, size), size)
        assert [p.recv for p in phases] == [p.send for p in left]


def test_single_rank_has_nothing_to_do_and_bad_rank_is_refused():
    assert schedule.allreduce_phases(0, 1) == []
    with pytest.raises(ValueError, match="rank 3 outside ring of size 3"):
        schedule.allreduce_phases(3, 3)


def simulate(bufs: list[np.ndarray], chunk: int) -> None:
    """Run the schedule over in-memory buffers, phase by phase, exactly as the engine does."""
    size, n = len(bufs), bufs[0].size
    bounds = schedule.segment_bounds(n, size)
    for p in range(2 * (size - 1)):
        sent = {}
        for r in range(size):
            ph = schedule.allreduce_phases(r, size)[p]
            sent[schedule.right(r, size)] = bufs[r][slice(*bounds[ph.send])].copy()
        for r in range(size):
            ph = schedule.allreduce_phases(r, size)[p]
            data = sent[r]
            a0 = bounds[ph.recv][0]
            for a, b in schedule.chunks(*bounds[ph.recv], chunk):
                seg = bufs[r][a:b]
                if ph.reduce:
                    np.add(seg, data[a - a0 : b - a0], out=seg)
                    if p == size - 2:
                        np.divide(seg, size, out=seg)
                else:
                    seg[...] = data[a - a0 : b - a0]


@pytest.mark.parametrize("size", [2, 3, 4, 6])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 100, 1001])
def test_simulated_ring_computes_the_mean(size, n):
    rng = np.random.default_rng(n * 10 + size)
    bufs = [rng.standard_normal(n).astype(np.float32) for _ in range(size)]
    want = np.mean(np.stack(bufs).astype(np.float64), axis=0) if n else np.zeros(0)
    simulate(bufs, chunk=3)
    for b in bufs:
        np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_neighbours_are_left_then_right_and_close_the_ring(size):
    for rank in range(size):
        left, right = schedule.neighbours(rank, size)
        assert (left, right) == (schedule.left(rank, size), schedule.right(rank, size))
        assert schedule.neighbours(right, size)[0] == rank  # my right receives from me
    assert schedule.neighbours(0, 3) == (2, 1)
