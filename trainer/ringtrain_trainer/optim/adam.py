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

from ringtrain_trainer.optim.base import Optimizer, f32


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

    def prepare(self):
        t = self.iterations
        self.alpha = self.lr * math.sqrt(1 - self.beta_2**t) / (1 - self.beta_1**t)

    def update(self, g, w, s):
        m, v = self.state["m"][s], self.state["v"][s]
        a, b = self._scratch[s], self._scratch2[s]
        np.subtract(g, m, out=a)
        np.multiply(a, f32(1 - self.beta_1), out=a)
        np.add(m, a, out=m)
        self.square(g, s, out=a)
        np.subtract(a, v, out=a)
        np.multiply(a, f32(1 - self.beta_2), out=a)
        np.add(v, a, out=v)
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
