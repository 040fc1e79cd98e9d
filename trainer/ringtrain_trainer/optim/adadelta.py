"""Keras ``Adadelta`` (rho, epsilon), ``keras/src/optimizers/adadelta.py``::

a = rho * a + (1 - rho) * g*g                         (the accumulated squared gradient)
delta = -sqrt(d + epsilon) * g / sqrt(a + epsilon)     (d: the accumulated squared update)
d = rho * d + (1 - rho) * delta*delta
w += lr * delta
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class Adadelta(Optimizer):
    name = "adadelta"
    squares = True
    state_names = ("accumulated_grad", "accumulated_delta_var")

    def __init__(self, params, schedule, rho=0.95, epsilon=1e-7, weight_decay=None):
        self.rho, self.epsilon = float(rho), float(epsilon)
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)

    def update(self, g, w, s):
        acc, dv = self.state["accumulated_grad"][s], self.state["accumulated_delta_var"][s]
        a, b = self._scratch[s], self._scratch2[s]
        rho, one, eps = f32(self.rho), f32(1 - self.rho), f32(self.epsilon)
        np.multiply(acc, rho, out=acc)
        self.square(g, s, out=a)
        np.multiply(a, one, out=a)
        np.add(acc, a, out=acc)
        np.add(dv, eps, out=a)
        np.sqrt(a, out=a)
        np.multiply(a, g, out=a)
        np.add(acc, eps, out=b)
        np.sqrt(b, out=b)
        np.divide(a, b, out=a)  # -delta
        np.multiply(dv, rho, out=dv)
        np.multiply(a, a, out=b)
        np.multiply(b, one, out=b)
        np.add(dv, b, out=dv)
        np.multiply(a, f32(self.lr), out=a)
        np.subtract(w, a, out=w)
