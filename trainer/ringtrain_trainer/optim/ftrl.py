"""Keras ``Ftrl`` (learning_rate_power, initial_accumulator_value, l1/l2/l2-shrinkage
regularization strengths, beta), ``keras/src/optimizers/ftrl.py``::

n' = n + g*g                                   (n starts at initial_accumulator_value)
z += g + 2 * l2_shrinkage * w - (n'**-p - n**-p) / lr * w          (p = learning_rate_power)
w = (clip(z, -l1, l1) - z) / (n'**-p / lr + 2 * (l2 + beta / (2 lr)));  n = n'
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class Ftrl(Optimizer):
    name = "ftrl"
    state_names = ("accumulator", "linear")
    squares = True

    def __init__(
        self,
        params,
        schedule,
        learning_rate_power=-0.5,
        initial_accumulator_value=0.1,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        l2_shrinkage_regularization_strength=0.0,
        beta=0.0,
        weight_decay=None,
    ):
        self.power = -float(learning_rate_power)
        self.l1 = float(l1_regularization_strength)
        self.l2 = float(l2_regularization_strength)
        self.shrink = float(l2_shrinkage_regularization_strength)
        self.beta = float(beta)
        super().__init__(params, schedule, weight_decay)
        self.state["accumulator"].fill(float(initial_accumulator_value))
        self._scratch2 = np.zeros_like(params)

    def update(self, g, w, s):
        n, z = self.state["accumulator"][s], self.state["linear"][s]
        a, b = self._scratch[s], self._scratch2[s]
        lr = f32(self.lr)
        self.square(g, s, out=a)
        np.add(n, a, out=a)  # n'
        np.power(n, f32(self.power), out=n)
        np.power(a, f32(self.power), out=b)
        np.subtract(b, n, out=n)
        np.divide(n, lr, out=n)
        np.multiply(n, w, out=n)
        np.subtract(z, n, out=z)
        np.add(z, g, out=z)
        if self.shrink:
            np.multiply(w, f32(2 * self.shrink), out=n)
            np.add(z, n, out=z)
        np.divide(b, lr, out=b)
        np.add(b, f32(2 * (self.l2 + self.beta / (2.0 * self.lr))), out=b)
        np.clip(z, -f32(self.l1), f32(self.l1), out=n)
        np.subtract(n, z, out=n)
        np.divide(n, b, out=w)
        np.copyto(n, a)
