"""Keras ``Adam`` (amsgrad) and ``AdamW``: the "epsilon hat" form of Keras' ``adam.py``::

    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)        (t = iterations, this step counted)
    m += (g - m) * (1 - beta_1);  v += (g*g - v) * (1 - beta_2)
    amsgrad: v_hat = max(v_hat, v), used in place of v
    w -= alpha * m / (sqrt(v) + epsilon)

AdamW is Adam with a default decoupled ``weight_decay`` of 0.004 (done in :mod:`.base`).
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine import native
from ringtrain_trainer.optim.base import Optimizer, f32


def update_moments(opt: Optimizer, g, s, beta_1: float, beta_2: float, scratch) -> tuple:
    """Keras' ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)`` on slice ``s``
    of ``opt``'s ``m`` and ``v`` (in place, ``scratch`` as work space; ``g*g`` by
    :meth:`Optimizer.square`, Keras' per-occurrence square on Embedding rows): Adam's and
    Nadam's shared first step. Returns the two views."""
    m, v = opt.state["m"][s], opt.state["v"][s]
    np.subtract(g, m, out=scratch)
    np.multiply(scratch, f32(1 - beta_1), out=scratch)
    np.add(m, scratch, out=m)
    opt.square(g, s, out=scratch)
    np.subtract(scratch, v, out=scratch)
    np.multiply(scratch, f32(1 - beta_2), out=scratch)
    np.add(v, scratch, out=v)
    return m, v


class Adam(Optimizer):
    name = "adam"
    squares = True

    def __init__(
        self,
        params,
        schedule,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
        weight_decay=None,
    ):
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.amsgrad = bool(amsgrad)
        self.state_names = ("m", "v", "v_hat") if self.amsgrad else ("m", "v")
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)
        self.alpha = 0.0
        #: the compiled one-pass step (``engine.native``): float32, without amsgrad
        k = native.kernels
        self.fused = k.adam_update if k and not self.amsgrad and params.dtype == f32 else None

    def prepare(self):
        t = self.iterations
        self.alpha = self.lr * math.sqrt(1 - self.beta_2**t) / (1 - self.beta_1**t)

    def update(self, g, w, s):
        if self.fused is not None and self.sparse is None and g.dtype == f32:
            # one pass, the same float32 operations per element as below: the same bits
            self.fused(
                g, w, self.state["m"][s], self.state["v"][s],
                f32(1 - self.beta_1), f32(1 - self.beta_2), f32(self.epsilon),
                f32(self.alpha), self.threads,
            )  # fmt: skip
            return
        a, b = self._scratch[s], self._scratch2[s]
        m, v = update_moments(self, g, s, self.beta_1, self.beta_2, a)
        if self.amsgrad:
            vh = self.state["v_hat"][s]
            np.maximum(vh, v, out=vh)
            v = vh
        np.sqrt(v, out=b)
        np.add(b, f32(self.epsilon), out=b)
        np.multiply(m, f32(self.alpha), out=a)
        np.divide(a, b, out=a)
        np.subtract(w, a, out=w)


class AdamW(Adam):
    name = "adamw"
