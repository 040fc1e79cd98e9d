"""Run one op the way ``engine.program.Program`` runs a node, outside a model: its planned
buffers, ``bind``, forward, ``backward_local``, then both halves. Shared by the op tests
(finite differences, and real Keras layers), so every op is driven through the one protocol.
"""

from __future__ import annotations

import numpy as np


def compile_op(op, batch: int, dtype=np.float64, train: bool = True) -> dict:
    bufs = op.buffers(batch, train, need_dx=True)
    ws = {k: np.zeros(s, dtype if t == "f" else np.bool_) for k, (s, t) in bufs.items()}
    ws.update({n: np.full(size, v, dtype) for n, size, v in op.state_specs()})
    ws["ctx"] = {"seed": 5, "step": 2, "example0": 4}
    op.bind(ws, batch)
    return ws


def backward(op, ws, xs, params, dout):
    """Input gradients (copies, one per input; ``None`` for data inputs) and every weight
    gradient, whole."""
    op.backward_local(ws, dout)
    dxs = op.backward_input(ws, dout, **params)
    if len(xs) == 1:
        dxs = (dxs,)
    dxs = [None if d is None else np.array(d) for d in dxs]
    grads = {}
    for p in op.params(0):
        grads[p.name] = np.zeros(p.shape, dout.dtype)
        op.backward_weights(ws, dout, p.name, grads[p.name], (0, p.rows))
    return dxs, grads
