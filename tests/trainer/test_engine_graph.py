"""The engine's graph: order, fan-out, refusals, and gradient accumulation for a tensor read
twice, checked against finite differences on a small hand-built diamond."""

import numpy as np
import pytest
from support.gradcheck import check_model

from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.graph import Graph, GraphError, Node
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.elementwise import Add, Elementwise


def test_a_chain_keeps_layer_order_and_fans_nothing_out():
    g = Graph.chain(3)
    assert g.order == [0, 1, 2] and g.backward_order() == [2, 1, 0]
    assert g.inputs == (0,) and g.outputs == (3,)
    assert g.fanned_out() == [] and g.consumers[1] == (1,)


def test_topological_order_and_the_fan_out_map():
    # listed out of order: node 0 reads what node 2 writes
    g = Graph([Node(0, (3,), 4), Node(1, (0,), 1), Node(2, (1, 1), 3)], (0,), (4,))
    assert g.order == [1, 2, 0]
    assert g.fanned_out() == [1]  # read twice by one node counts as fan-out
    assert g.consumers[1] == (2,) and g.producer[4] == 0


@pytest.mark.parametrize(
    "nodes, match",
    [
        ([Node(0, (5,), 1)], "reads tensor 5, which nothing writes"),
        ([Node(0, (0,), 1), Node(1, (0,), 1)], "written twice"),
        ([Node(0, (2,), 1), Node(1, (1,), 2)], "cycle through nodes"),
    ],
)
def test_graphs_that_cannot_run_are_refused(nodes, match):
    with pytest.raises(GraphError, match=match):
        Graph(nodes, (0,), (1,))


def diamond() -> M.ModelSpec:
    """x → Dense(6) → h;  h → ReLU → r;  Add(r, h) → Dense(3) → logits: ``h`` is read twice."""
    graph = Graph(
        [Node(0, (0,), 1), Node(1, (1,), 2), Node(2, (2, 1), 3), Node(3, (3,), 4)], (0,), (4,)
    )
    layers = [
        Dense((5,), 6, "tanh", fast=False),
        Elementwise((6,), "relu"),
        Add((6,)),
        Dense((6,), 3),
    ]
    return M.ModelSpec("diamond", layers, (5,), 3, graph)


def test_a_tensor_read_twice_sums_both_gradients_like_finite_differences(rng):
    spec = diamond()
    prog = M.Program(spec, 4, True, np.float64)
    assert list(prog.acc) == [1] and prog.acc[1].shape == (4, 6)
    flat = spec.init(3, np.float64) + rng.normal(0, 0.3, spec.num_params)
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog.x[:] = rng.normal(size=prog.x.shape)
    prog.labels[:] = rng.integers(0, 3, 4)

    def loss():
        return prog.loss_and_dlogits(prog.forward(views))

    for _ in range(2):  # the accumulator starts over every step
        grad[:] = 0
        loss()
        pieces = list(prog.backward_pieces(views, gviews))
    assert pieces == spec.grad_pieces
    check_model(spec, flat, grad, loss, rng, samples=None)


def test_the_diamond_plans_its_accumulator_as_workspace():
    spec = diamond()
    train = M.Program.buffer_bytes(spec, 4, True, 8)
    assert train["workspace"] - M.Program.buffer_bytes(spec, 4, False, 8)["workspace"] >= 4 * 6 * 8
    assert not M.Program(spec, 4, False, np.float64).acc


def test_the_memory_table_counts_the_accumulator_in_the_producers_row():
    from ringtrain_trainer.ipu.memory import plan_memory

    spec = diamond()
    plan = plan_memory(spec, 4, True, 8, 1 << 30, 0)
    assert plan.workspace == M.Program.buffer_bytes(spec, 4, True, 8)["workspace"]
    evaluation = plan_memory(spec, 4, False, 8, 1 << 30, 0)
    assert plan.by_layer[0].workspace - evaluation.by_layer[0].workspace >= 4 * 6 * 8


def test_the_ipu_runs_a_graph_in_shards_and_replicas_like_one_program(rng):
    """Accumulators per shard: 2 replicas x 2 host threads give one program's gradient."""
    from ringtrain_trainer.ipu.device import IPU, IPUConfig

    spec = diamond()
    x = rng.normal(size=(8, 5)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    ipus = []
    for replicas, threads in ((1, 1), (2, 2)):
        params = spec.init(1)
        ipu = IPU(spec, IPUConfig(replicas=replicas, host_threads=threads), params, 0 * params)
        ipu.train_step(ipu.compile(8), x, y)
        ipus.append(ipu)
    np.testing.assert_allclose(ipus[1].host_grads, ipus[0].host_grads, rtol=1e-5, atol=1e-7)
    accuracy = ipus[0].evaluate(x, y, batch=4)
    logits = ipus[0].compile(4, train=False).programs[0].output
    assert logits.shape == (4, 3) and 0 <= accuracy <= 1
    for ipu in ipus:
        ipu.close()


def test_backward_stops_where_nothing_upstream_trains():
    """A frozen base (nodes 0, 1) under a trainable head (2) fed by a side branch (3 reads
    the input, trains): no gradient for the base's tensors, so the head computes no input
    gradient toward it and the base runs no backward; the branch keeps its own."""
    g = Graph(
        [Node(0, (0,), 1), Node(1, (1,), 2), Node(2, (2, 4), 3), Node(3, (0,), 4)], (0,), (3,)
    )
    h = g.without_grad_before({2, 3})
    assert [h.needs_grad(t) for t in (1, 2, 3, 4)] == [False, False, True, True]
    assert h.no_grad == {1, 2} and g.no_grad == frozenset()
    assert Graph.chain(3).without_grad_before({0}).no_grad == frozenset()
