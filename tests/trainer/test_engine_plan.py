"""The compile plan's parameter side: layout in reverse backward order and the piece grid cut
from one constant for every op alike; the Program announces exactly those pieces, each final."""

import itertools

import numpy as np
import pytest
from test_engine_graph import diamond

from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine import plan
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.shape import Reshape
from ringtrain_trainer.engine.tensor import ParamSpec


def test_parameters_are_laid_out_in_reverse_backward_order():
    spec = diamond()  # backward: node 3 (Dense), 2 (Add), 1 (ReLU), 0 (Linear)
    assert [(s.spec.layer, s.spec.name) for s in spec.slots] == [
        (3, "bias"),
        (3, "kernel"),
        (0, "bias"),
        (0, "kernel"),
    ]
    assert spec.slots[0].start == 0 and spec.slots[-1].stop == spec.num_params


@pytest.mark.parametrize("shape", [(10,), (70000,), (5408, 64), (3, 3, 64, 128), (7, 65537)])
def test_row_blocks_are_whole_rows_about_equal_and_at_most_the_constant(shape):
    p = ParamSpec(0, "kernel", shape, 1, 1, True)
    blocks = plan.row_blocks(p)
    assert blocks[0][0] == 0 and blocks[-1][1] == p.rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [hi - lo for lo, hi in blocks]
    row = p.size // p.rows
    if p.rows > 1:
        assert max(sizes) * row <= plan.GRAD_BLOCK_ELEMS or max(sizes) == 1
    assert max(sizes) - min(sizes) <= len(sizes)
    assert (len(blocks) == 1) == (p.size <= plan.GRAD_BLOCK_ELEMS or p.rows == 1)


def test_row_blocks_only_where_a_ring_can_overlap_them():
    assert plan.block_elems_for(2) == plan.GRAD_BLOCK_ELEMS
    big = ParamSpec(0, "kernel", (5408, 64), 5408, 64, True)
    assert plan.row_blocks(big, plan.block_elems_for(1)) == [(0, 5408)]


def test_every_op_streams_on_the_same_grid():
    """The general Dense (``Linear``) and Conv2D block a large kernel exactly as the fused
    Dense does: the grid is the plan's, not a layer's choice."""
    layers = [
        Conv((4, 4, 64), 128, (3, 3), padding="same"),  # 73,728-element kernel
        Reshape((4, 4, 128), (2048,)),
        Dense((2048,), 40, "tanh", fast=False),  # 81,920 elements
        Dense((40,), 10, fast=False),
    ]
    spec = M.ModelSpec("wide", layers, (4, 4, 64), 10)
    by_param = {(p.node, p.name): 0 for p in spec.pieces}
    for p in spec.pieces:
        by_param[p.node, p.name] += 1
    assert by_param == {
        (3, "bias"): 1,
        (3, "kernel"): 1,
        (2, "bias"): 1,
        (2, "kernel"): 2,
        (0, "bias"): 1,
        (0, "kernel"): 2,
    }
    assert spec.grad_pieces[0][0] == 0 and spec.grad_pieces[-1][1] == spec.num_params
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spec.grad_pieces))
    assert [sum(x) for x in spec.param_pieces] == [s.stop - s.start for s in spec.slots]


@pytest.mark.parametrize("grads_first", [False, True])
def test_the_program_announces_each_piece_once_final_in_plan_order(rng, grads_first):
    layers = [
        Reshape((6, 6, 4), (144,)),
        Dense((144,), 500, "tanh", fast=False),
        Dense((500,), 3, fast=False),
    ]
    spec = M.ModelSpec("blocked", layers, (6, 6, 4), 3)
    assert len(spec.pieces) > 4  # the 72,000-element kernel is cut in two
    params = spec.init(1, np.float64)
    whole, pieced = np.zeros_like(params), np.zeros_like(params)
    views = spec.views(params)
    ref = M.Program(spec, 4, True, np.float64)
    prog = M.Program(spec, 4, True, np.float64, grads_first=grads_first)
    x = rng.random(ref.x.shape)
    for p in (ref, prog):
        p.x[:] = x
        p.labels[:] = [0, 1, 2, 1]
        p.loss_and_dlogits(p.forward(views))
    for _ in ref.backward_pieces(views, spec.views(whole)):
        pass
    seen = []
    for a, b in prog.backward_pieces(views, spec.views(pieced)):
        seen.append((a, b, pieced[a:b].copy()))
    assert [(a, b) for a, b, _ in seen] == spec.grad_pieces
    np.testing.assert_array_equal(np.concatenate([g for _, _, g in seen]), whole)
