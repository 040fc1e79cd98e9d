"""Keras ``RMSprop`` (rho, momentum, epsilon, centered), ``keras/src/optimizers/rmsprop.py``::

v = rho * v + (1 - rho) * g*g
centered: a = rho * a + (1 - rho) * g;  d = v - a*a + epsilon   (else d = v + epsilon)
inc = lr * g / sqrt(d)
momentum > 0: m = momentum * m + inc;  w -= m                    (else w -= inc)
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class RMSprop(Optimizer):
    name = "rmsprop"
    squares = True

    def __init__(
        self, params, schedule, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False,
        weight_decay=None,
    ):  # fmt: skip
        self.rho, self.momentum, self.epsilon = float(rho), float(momentum), float(epsilon)
        self.centered = bool(centered)
        names = ["velocity"]
        if self.momentum > 0:
            names.append("momentum")
        if self.centered:
            names.append("average_gradient")
        self.state_names = tuple(names)
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)

    def update(self, g, w, s):
        v, a, d = self.state["velocity"][s], self._scratch[s], self._scratch2[s]
        rho = f32(self.rho)
        np.multiply(v, rho, out=v)
        self.square(g, s, out=a)
        np.multiply(a, f32(1 - self.rho), out=a)
        np.add(v, a, out=v)
        if self.centered:
            avg = self.state["average_gradient"][s]
            np.multiply(avg, rho, out=avg)
            np.multiply(g, f32(1 - self.rho), out=a)
            np.add(avg, a, out=avg)
            np.multiply(avg, avg, out=a)
            np.subtract(v, a, out=d)
            np.add(d, f32(self.epsilon), out=d)
        else:
            np.add(v, f32(self.epsilon), out=d)
        np.sqrt(d, out=d)
        np.multiply(g, f32(self.lr), out=a)
        np.divide(a, d, out=a)
        if self.momentum > 0:
            m = self.state["momentum"][s]
            np.multiply(m, f32(self.momentum), out=m)
            np.add(m, a, out=m)
            np.subtract(w, m, out=w)
        else:
            np.subtract(w, a, out=w)
