"""Keras ``Nadam`` (beta_1, beta_2, epsilon), ``keras/src/optimizers/nadam.py``::

u_t = beta_1 * (1 - 0.5 * 0.96**t);  u_t1 = beta_1 * (1 - 0.5 * 0.96**(t+1))
P_t = u_1 * ... * u_t (Keras' ``_u_product``);  P_t1 = P_t * u_t1      (t: this step counted)
m += (g - m) * (1 - beta_1);  v += (g*g - v) * (1 - beta_2)
m_hat = u_t1 * m / (1 - P_t1) + (1 - u_t) * g / (1 - P_t);  v_hat = v / (1 - beta_2**t)
w -= lr * m_hat / (sqrt(v_hat) + epsilon)

``P_t`` is a function of the step count alone, so it is recomputed from ``iterations`` (after a
resume too) and not stored beside the parameter-sized slots.
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.adam import update_moments
from ringtrain_trainer.optim.base import Optimizer, f32


class Nadam(Optimizer):
    name = "nadam"
    state_names = ("m", "v")
    squares = True

    def __init__(self, params, schedule, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None):
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)
        self._u_steps, self._u_product = 0, 1.0
        self.c_m = self.c_g = self.c_v = 0.0

    def _u(self, t: int) -> float:
        return self.beta_1 * (1.0 - 0.5 * 0.96**t)

    def prepare(self):
        t = self.iterations
        if self._u_steps > t:
            self._u_steps, self._u_product = 0, 1.0
        while self._u_steps < t:
            self._u_steps += 1
            self._u_product *= self._u(self._u_steps)
        p, p1 = self._u_product, self._u_product * self._u(t + 1)
        self.c_m = self._u(t + 1) / (1 - p1)
        self.c_g = (1 - self._u(t)) / (1 - p)
        self.c_v = 1.0 / (1 - self.beta_2**t)

    def update(self, g, w, s):
        a, b = self._scratch[s], self._scratch2[s]
        m, v = update_moments(self, g, s, self.beta_1, self.beta_2, a)
        np.multiply(v, f32(self.c_v), out=b)
        np.sqrt(b, out=b)
        np.add(b, f32(self.epsilon), out=b)
        # m_hat * lr = (g * c_g / c_m + m) * c_m * lr: one scratch block for both terms
        np.multiply(g, f32(self.c_g / self.c_m), out=a)
        np.add(a, m, out=a)
        np.multiply(a, f32(self.c_m * self.lr), out=a)
        np.divide(a, b, out=a)
        np.subtract(w, a, out=w)
