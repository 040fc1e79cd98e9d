"""Keras ``Adamax`` (beta_1, beta_2, epsilon), ``keras/src/optimizers/adamax.py``::

m += (g - m) * (1 - beta_1);  u = max(beta_2 * u, |g|)          (t: this step counted)
w -= lr * m / ((1 - beta_1**t) * (u + epsilon))
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class Adamax(Optimizer):
    name = "adamax"
    state_names = ("m", "u")

    def __init__(self, params, schedule, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None):
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        super().__init__(params, schedule, weight_decay)
        self.correction = 1.0

    def prepare(self):
        self.correction = 1.0 - self.beta_1**self.iterations

    def update(self, g, w, s):
        m, u, a = self.state["m"][s], self.state["u"][s], self._scratch[s]
        np.subtract(g, m, out=a)
        np.multiply(a, f32(1 - self.beta_1), out=a)
        np.add(m, a, out=m)
        np.multiply(u, f32(self.beta_2), out=u)
        np.abs(g, out=a)
        np.maximum(u, a, out=u)
        np.add(u, f32(self.epsilon), out=a)
        np.multiply(a, f32(self.correction), out=a)
        np.divide(m, a, out=a)
        np.multiply(a, f32(self.lr), out=a)
        np.subtract(w, a, out=w)
