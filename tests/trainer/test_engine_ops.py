"""Every op of the engine against finite differences, through the op protocol itself:
``forward``, ``backward_local``, ``backward_input`` and ``backward_weights`` (whole and in row
blocks), with one shared helper (``support.gradcheck``). A new op joins by adding a case here;
the registry test fails until it does."""

import inspect
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from support.gradcheck import gradcheck

from ringtrain_trainer.engine.ops import (
    activity,
    augment,
    broadcast,
    dropout,
    fused,
    merge,
    noise,
    score_attention,
    standardize,
)
from ringtrain_trainer.engine.ops.batchnorm import BatchNorm
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.dropout import Dropout
from ringtrain_trainer.engine.ops.elementwise import Add, Elementwise
from ringtrain_trainer.engine.ops.pool import GlobalPool, Pool
from ringtrain_trainer.engine.ops.shape import Reshape

B = 3


def _registry() -> set[type]:
    """Every op class the engine ships: the general layers, the fused fast path and the
    ``engine/ops`` families."""
    general = SimpleNamespace(  # the ops that were the ``layers`` package's
        Add=Add,
        BatchNorm=BatchNorm,
        Dropout=Dropout,
        Elementwise=Elementwise,
        Dense=Dense,
        Reshape=Reshape,
    )
    mods = [
        general,
        fused,
        merge,
        broadcast,
        dropout,
        noise,
        activity,
        augment,
        standardize,
        score_attention,
    ]
    return {
        c
        for m in mods
        for _, c in inspect.getmembers(m, inspect.isclass)
        if hasattr(c, "forward") and c.__module__.startswith("ringtrain_trainer.engine.ops")
    }


CASES = {
    "conv-same-strided-tanh": Conv((5, 5, 2), 3, (3, 2), (2, 1), "same", 1, "tanh", True),
    "conv-valid-sigmoid-nobias": Conv((4, 4, 2), 2, (2, 2), (1, 1), "valid", 1, "sigmoid", False),
    "maxpool-same": Pool((4, 5, 2), "max", (2, 2), (2, 2), "same"),
    "avgpool-same": Pool((5, 4, 2), "avg", (3, 2), (2, 1), "same"),
    "global-avg": GlobalPool((3, 3, 2), "avg"),
    **{
        f"elementwise-{a}": Elementwise((4,), a, scale=0.5, offset=0.1)
        for a in ("linear", "relu", "sigmoid", "tanh", "softmax")
    },
    "linear-tanh": Dense((4,), 3, "tanh", True, fast=False),
    "linear-softmax-nobias": Dense((4,), 3, "softmax", False, fast=False),
    "linear-gelu": Dense((4,), 3, "gelu", True, fast=False),
    "linear-identity": Dense((4,), 3, "linear", True, fast=False),
    "dropout": Dropout((6,), 0.5, 1),
    "reshape": Reshape((2, 3), (6,)),
    "batchnorm": BatchNorm((5, 3), 0.9, 1e-3, True, True),
    "batchnorm-center-only": BatchNorm((4,), 0.9, 1e-3, True, False),
    "add": Add((2, 3)),
    "add3": Add((4,), 3),
    "convpool": fused.ConvPool((6, 6, 2), 3),
    "convpool-one-channel": fused.ConvPool((7, 6, 1), 2, 2),
    "dense-relu": Dense((5,), 4, "relu"),
    "dense": Dense((5,), 4),
    **{f"merge-{m}": merge.Merge((2, 3), m) for m in merge.MODES},
    **{f"merge3-{m}": merge.Merge((4,), m, 3) for m in merge.MODES if m != "subtract"},
    "concatenate-last": merge.Concatenate([(2, 3), (2, 1)], -1),
    **{
        f"broadcast-{m}-{k}": broadcast.Broadcast(shapes, m)
        for m in broadcast.UFUNCS
        for k, shapes in {"se": [(3, 2, 4), (1, 1, 4)], "both": [(1, 3), (2, 1)]}.items()
    },
    "shared-dropout-spatial": dropout.SharedDropout((3, 2, 4), 0.5, 2, (1, 1, 4)),
    "shared-dropout-example": dropout.SharedDropout((5, 2), 0.3, 2, (1, 1)),
    "activity-l1-l2": activity.ActivityPenalty((2, 3), 0.3, 0.2),
    # layer 0 at compile_op's seed, step and examples: the first and last image flip
    **{f"flip-{m}": augment.RandomFlip((3, 2, 2), m, 0) for m in augment.FLIP_MODES},
    **{
        f"rotation-{f}-{i}": augment.RandomAffine(
            (4, 3, 2), "rotation", [(-0.3, 0.3)], f, i, 0.5, 0
        )
        for f in augment.FILL_MODES
        for i in augment.INTERPOLATIONS
    },
    "zoom": augment.RandomAffine((4, 3, 2), "zoom", [(-0.4, 0.3)], "wrap", "bilinear", 0.0, 0),
    "translation": augment.RandomAffine(
        (4, 3, 2), "translation", [(-0.4, 0.4), (-0.5, 0.2)], "reflect", "bilinear", 0.0, 0
    ),
    "activity-on-linear": activity.WithActivity(Dense((4,), 3, "tanh", True, fast=False), 0.2, 0.3),
    **{f"noise-{m}": noise.Noise((2, 3), m, 0.3, 2) for m in noise.MODES},
    "standardize-adapted": standardize.Standardize((2, 3)),
    "standardize-fixed": standardize.Standardize((4,), [1.0, 2.0, 0.0, -1.0], [4.0, 0.25, 9, 1]),
    "concatenate-first3": merge.Concatenate([(1, 3), (2, 3), (3, 3)], 0),
    **{
        f"attention-{m}-{'scaled' if sc else 'plain'}-{len(sh)}in{'-causal' if ca else ''}": (
            score_attention.ScoreAttention(sh, m, sc, ca)
        )
        for m in score_attention.MODES
        for sc in (False, True)
        for sh, ca in (([(3, 4), (5, 2), (5, 4)], False), ([(4, 3), (4, 3)], True))
    },
}


def test_every_op_class_has_a_gradient_check():
    assert _registry() - {type(op) for op in CASES.values()} == set()


def compile_op(op, rng):
    """What the Program does for one node, in float64: buffers, state, bind; random inputs,
    parameters and an upstream gradient ``w`` (the loss is ``sum(out * w)``)."""
    bufs = op.buffers(B, True, need_dx=True)
    ws = {k: np.zeros(s, np.float64 if t == "f" else np.bool_) for k, (s, t) in bufs.items()}
    ws.update({n: np.full(size, v) for n, size, v in op.state_specs()})
    ws["ctx"] = {"seed": 5, "step": 2, "example0": 4}
    op.bind(ws, B)
    n_in = getattr(op, "n_inputs", 1)
    shapes = (
        getattr(op, "in_shapes", None)
        or [op.in_shape if hasattr(op, "in_shape") else (op.n_in,)] * n_in
    )
    xs = [rng.normal(size=(B, *s)) for s in shapes]
    params = {p.name: rng.normal(0.5, 0.5, p.shape) for p in op.params(0)}
    w = rng.normal(size=(B, *op.out_shape))
    return ws, xs, params, w


@pytest.mark.parametrize("case", list(CASES))
def test_op_gradients_match_finite_differences(case, rng):
    op = CASES[case]
    ws, xs, params, w = compile_op(op, rng)

    def loss():
        out = float(np.sum(op.forward(ws, *xs, **params) * w))
        return out + (op.penalty(ws) if hasattr(op, "penalty") else 0.0)  # a loss term

    loss()
    dout = w.copy()
    op.backward_local(ws, dout)
    dxs = op.backward_input(ws, dout, **params)
    dxs = [np.array(d) for d in (dxs if len(xs) > 1 else (dxs,))]  # copies: reruns overwrite
    grads = {}
    for p in op.params(0):
        grads[p.name] = np.zeros(p.shape)
        op.backward_weights(ws, dout, p.name, grads[p.name], (0, p.rows))
    for k, (x, dx) in enumerate(zip(xs, dxs, strict=True)):
        gradcheck(loss, x, dx, what=f"{case} input {k}")
    for name, g in grads.items():
        gradcheck(loss, params[name], g, rng=rng, samples=20, what=f"{case} {name}")


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].params(0)])
def test_weight_gradients_in_row_blocks_equal_the_whole(case, rng):
    """The piece grid may cut any parameter into row blocks; every op computes a block alone."""
    op = CASES[case]
    ws, xs, params, w = compile_op(op, rng)
    op.forward(ws, *xs, **params)
    op.backward_local(ws, w)
    for p in op.params(0):
        whole, blocks = np.zeros(p.shape), np.full(p.shape, np.nan)
        op.backward_weights(ws, w, p.name, whole, (0, p.rows))
        cut = [0, *sorted({max(1, p.rows // 3), max(1, 2 * p.rows // 3)}), p.rows]
        for lo, hi in itertools.pairwise(cut):
            if hi > lo:
                op.backward_weights(ws, w, p.name, blocks, (lo, hi))
        np.testing.assert_allclose(blocks, whole, rtol=1e-12, atol=0)
        assert math.prod(p.shape) == p.rows * (p.shape[-1] if p.shape else 1)


def test_no_op_decides_streaming():
    """The piece grid is the plan's (``engine.plan``): no op carries a gradient plan."""
    assert not [c.__name__ for c in _registry() if hasattr(c, "grad_plan")]


def test_the_gradcheck_helper_catches_a_wrong_gradient(rng):
    x = rng.normal(size=(3, 2))

    def f():
        return float(np.sum(x**3))

    gradcheck(f, x, 3 * x**2)
    with pytest.raises(AssertionError, match=r"disagree at \[\(4, "):
        gradcheck(f, x, 3 * x**2 + (np.arange(6) == 4).reshape(3, 2), what="cube")
    with pytest.raises(ValueError, match="float64"):
        gradcheck(f, x.astype(np.float32), 3 * x**2)


def test_every_engine_op_is_finite_difference_checked_somewhere():
    """Every op class of ``engine/ops`` goes through the one helper: a case here, or named in
    a test module that runs ``support.opcheck``/``support.gradcheck`` on it."""
    import importlib
    import pkgutil
    from pathlib import Path

    from ringtrain_trainer.engine import ops
    from ringtrain_trainer.engine.op import Op

    here = {type(op) for op in CASES.values()}
    tests = [
        p.read_text()
        for p in Path(__file__).parent.glob("test_*.py")
        if "support.opcheck" in p.read_text() or "support.gradcheck" in p.read_text()
    ]
    missing = []
    for m in pkgutil.iter_modules(ops.__path__):
        mod = importlib.import_module(f"{ops.__name__}.{m.name}")
        for _, c in inspect.getmembers(mod, inspect.isclass):
            private = c.__name__.startswith("_")  # a base class, checked through its heirs
            if private or c.__module__ != mod.__name__ or not issubclass(c, Op) or c in here:
                continue
            if not any(f"{c.__name__}(" in t for t in tests):
                missing.append(f"{m.name}.{c.__name__}")
    assert not missing, missing
