"""Keras ``Lion`` (beta_1, beta_2), ``keras/src/optimizers/lion.py``::

w -= lr * sign(m * beta_1 + g * (1 - beta_1))
m = m * beta_2 + g * (1 - beta_2)
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class Lion(Optimizer):
    name = "lion"
    state_names = ("m",)

    def __init__(self, params, schedule, beta_1=0.9, beta_2=0.99, weight_decay=None):
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)

    def update(self, g, w, s):
        m, a, b = self.state["m"][s], self._scratch[s], self._scratch2[s]
        np.multiply(m, f32(self.beta_1), out=a)
        np.multiply(g, f32(1 - self.beta_1), out=b)
        np.add(a, b, out=a)
        np.sign(a, out=a)
        np.multiply(a, f32(self.lr), out=a)
        np.subtract(w, a, out=w)
        np.multiply(m, f32(self.beta_2), out=m)
        np.multiply(g, f32(1 - self.beta_2), out=b)
        np.add(m, b, out=m)
