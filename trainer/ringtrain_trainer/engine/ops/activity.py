"""Keras' activity regularization (``ActivityRegularization(l1, l2)``): the identity whose
output adds ``(l1 * sum|x| + l2 * sum x²) / batch`` to the loss, as Keras 3's ``Op.__call__``
adds it (normalized by the batch size so the strength does not depend on it).

Why an op and not a loss: the term depends on an inner tensor, so its gradient
``(l1 sign(x) + 2 l2 x) / batch`` joins the upstream gradient at that node; the value joins
the program's loss (``Program.loss_and_dlogits`` asks every op with a ``penalty``). The penalty
is a mean over the local examples like the loss, so host threads, micro-batches and workers
average it as they average the loss. The gradient is multiplied by the step's loss scale
(``ctx["loss_scale"]``, set by the IPU) as the loss's own gradient is.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

import numpy as np

from ringtrain_trainer.engine.op import Op


class ActivityPenaltyWs(TypedDict, total=False):
    """The buffers :class:`ActivityPenalty` is compiled with (``buffers``, its state, ``bind``)."""

    ctx: dict[str, Any]
    dx: np.ndarray
    scratch: np.ndarray
    x: np.ndarray


class ActivityPenalty(Op):
    def __init__(self, shape, l1: float, l2: float):
        self.in_shape = self.out_shape = tuple(shape)
        self.l1, self.l2 = float(l1), float(l2)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        return {"dx": (shape, "f"), "scratch": (shape, "f")}

    def forward(self, ws: ActivityPenaltyWs, x):
        ws["x"] = x
        return x

    def penalty(self, ws: ActivityPenaltyWs) -> float:
        """This step's term (0 in evaluation), from the input the last forward saw."""
        x = ws.get("x")
        if x is None or "scratch" not in ws:
            return 0.0
        total = 0.0
        if self.l1:
            total += self.l1 * float(np.abs(x, out=ws["scratch"]).sum(dtype=np.float64))
        if self.l2:
            flat = x.reshape(-1)
            total += self.l2 * float(np.dot(flat, flat))
        return total / len(x)

    def backward_input(self, ws: ActivityPenaltyWs, dout):
        x, dx, s = ws["x"], ws["dx"], ws["scratch"]
        k = ws["ctx"].get("loss_scale", 1.0) / len(x)
        np.copyto(dx, dout.reshape(dx.shape))
        if self.l1:
            np.sign(x, out=s)
            s *= s.dtype.type(self.l1 * k)
            dx += s
        if self.l2:
            np.multiply(x, s.dtype.type(2 * self.l2 * k), out=s)
            dx += s
        return dx


class WithActivityWs(TypedDict, total=False):
    """The buffers :class:`WithActivity` is compiled with (``buffers``, its state, ``bind``)."""

    act_dx: np.ndarray
    act_scratch: np.ndarray
    act_x: np.ndarray
    ctx: dict[str, Any]


class WithActivity(Op):
    """Any op with Keras' ``activity_regularizer=`` (``L1``/``L2``/``L1L2``): the op, then the
    term of :class:`ActivityPenalty` on its output; the term's gradient is added to the
    upstream gradient before the op's own backward reads it (``backward_local``)."""

    def __init__(self, op, l1: float, l2: float):
        self.op, self.act = op, ActivityPenalty(op.out_shape, l1, l2)
        self.out_shape, self.kind = op.out_shape, op.kind
        self.batch_coupled = op.batch_coupled
        for k in ("in_shape", "in_shapes", "n_inputs", "n_in"):
            if hasattr(op, k):
                setattr(self, k, getattr(op, k))

    def params(self, layer):
        return self.op.params(layer)

    def state_specs(self):
        return self.op.state_specs()

    def flops(self, b, train, need_dx):
        return self.op.flops(b, train, need_dx)

    def buffers(self, b, train, need_dx):
        own = {f"act_{k}": v for k, v in self.act.buffers(b, train, need_dx).items()}
        return {**self.op.buffers(b, train, need_dx), **own}

    def bind(self, ws: WithActivityWs, b):
        self.op.bind(ws, b)

    def _own(self, ws: WithActivityWs) -> ActivityPenaltyWs:
        """The penalty's buffers under their own names (an absent one as None, which the
        penalty reads as "evaluation")."""
        own = {"x": ws.get("act_x"), "scratch": ws.get("act_scratch"), "dx": ws.get("act_dx")}
        return cast("ActivityPenaltyWs", own)

    def forward(self, ws: WithActivityWs, *xs, **params):
        out = self.op.forward(ws, *xs, **params)
        ws["act_x"] = out
        return out

    def penalty(self, ws: WithActivityWs) -> float:
        return self.act.penalty(self._own(ws))

    def backward_local(self, ws: WithActivityWs, dout):
        own = self._own(ws)
        own["ctx"] = ws["ctx"]
        np.copyto(dout, self.act.backward_input(own, dout).reshape(dout.shape))
        self.op.backward_local(ws, dout)

    def backward_input(self, ws: WithActivityWs, dout, **params):
        return self.op.backward_input(ws, dout, **params)

    def backward_weights(self, ws: WithActivityWs, dout, name, grad, rows):
        self.op.backward_weights(ws, dout, name, grad, rows)
