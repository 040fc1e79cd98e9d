"""Keras' activity regularization (``ActivityRegularization(l1, l2)``): the identity whose
output adds ``(l1 * sum|x| + l2 * sum x²) / batch`` to the loss, as Keras 3's ``Layer.__call__``
adds it (normalized by the batch size so the strength does not depend on it).

Why an op and not a loss: the term depends on an inner tensor, so its gradient
``(l1 sign(x) + 2 l2 x) / batch`` joins the upstream gradient at that node; the value joins
the program's loss (``Program.loss_and_dlogits`` asks every op with a ``penalty``). The penalty
is a mean over the local examples like the loss, so host threads, micro-batches and workers
average it as they average the loss. The gradient is multiplied by the step's loss scale
(``ctx["loss_scale"]``, set by the IPU) as the loss's own gradient is.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.layers.base import Layer


class ActivityPenalty(Layer):
    def __init__(self, shape, l1: float, l2: float):
        self.in_shape = self.out_shape = tuple(shape)
        self.l1, self.l2 = float(l1), float(l2)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        return {"dx": (shape, "f"), "scratch": (shape, "f")}

    def forward(self, ws, x):
        ws["x"] = x
        return x

    def penalty(self, ws) -> float:
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

    def backward_input(self, ws, dout):
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
