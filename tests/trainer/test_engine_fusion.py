"""The fused fast path equals the general ops it stands for: ``ConvPool`` is Conv2D(ReLU) then a
2x2 max-pool, the fused ``Dense`` is ``Linear`` — forward and every gradient. The equivalence a
fusion pass (ENGINE.md, step 6) must keep; today ``keras_model`` chooses the fused ops itself."""

import numpy as np
import pytest

from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops import fused
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.engine.ops.dense import Dense
from ringtrain_trainer.engine.ops.pool import Pool
from ringtrain_trainer.engine.ops.shape import Reshape


def fused_and_general(in_shape, filters, kernel):
    conv = fused.ConvPool(in_shape, filters, kernel)
    flat = int(np.prod(conv.out_shape))
    a = M.ModelSpec(
        "fused",
        [conv, Dense((flat,), 7, "relu"), Dense((7,), 4)],
        in_shape,
        4,
    )
    c = Conv(in_shape, filters, (kernel, kernel), activation="relu")
    p = Pool(c.out_shape, "max", (2, 2), (2, 2), "valid")
    b = M.ModelSpec(
        "general",
        [
            c,
            p,
            Reshape(p.out_shape, (flat,)),
            Dense((flat,), 7, "relu", fast=False),
            Dense((7,), 4, fast=False),
        ],
        in_shape,
        4,
    )
    return a, b, {0: 0, 1: 3, 2: 4}


@pytest.mark.parametrize("in_shape, filters, kernel", [((9, 8, 2), 3, 3), ((7, 7, 1), 2, 2)])
def test_the_fused_ops_equal_the_general_ops(rng, in_shape, filters, kernel):
    a, b, to_b = fused_and_general(in_shape, filters, kernel)
    pa = a.init(0, np.float64) + rng.normal(0, 0.1, a.num_params)
    pb, ga, gb = np.zeros(b.num_params), np.zeros_like(pa), np.zeros(b.num_params)
    va, vb, gva, gvb = a.views(pa), b.views(pb), a.views(ga), b.views(gb)
    for i, j in to_b.items():
        for name in va[i]:
            vb[j][name][...] = va[i][name]
    x, labels = rng.normal(size=(5, *in_shape)), rng.integers(0, 4, 5)
    logits = []
    for spec, views, grads in ((a, va, gva), (b, vb, gvb)):
        prog = M.Program(spec, 5, True, np.float64)
        prog.x[:] = x
        prog.labels[:] = labels
        logits.append(prog.forward(views).copy())
        prog.loss_and_dlogits(logits[-1])
        for _ in prog.backward_pieces(views, grads):
            pass
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-12, atol=1e-12)
    for i, j in to_b.items():
        for name in gva[i]:
            np.testing.assert_allclose(gva[i][name], gvb[j][name], rtol=1e-10, atol=1e-12)
