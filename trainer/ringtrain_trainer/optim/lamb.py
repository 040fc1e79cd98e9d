"""Keras ``Lamb`` (``keras/src/optimizers/lamb.py``), per weight tensor::

    t = iterations + 1
    m += (g - m) * (1 - beta_1);  v += (g*g - v) * (1 - beta_2)
    u = (m / (1 - beta_1**t)) / (sqrt(v / (1 - beta_2**t)) + epsilon)
    ratio = ||w|| / ||u|| where both are > 0, else 1         (the layer-wise trust ratio)
    w -= ratio * lr * u

Why a tensor at a time: the trust ratio's norms are over the whole tensor, so an update needs
the whole reduced tensor (the reducer's pieces may cut one anywhere): :class:`.clip.Clip`
hands it over when its last piece arrives, as for Adafactor and ``clipnorm``.
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.optim.adam import update_moments
from ringtrain_trainer.optim.base import Optimizer, f32


class Lamb(Optimizer):
    name = "lamb"
    squares = True
    whole_tensors = True
    state_names = ("m", "v")

    def __init__(
        self, params, schedule, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None
    ):  # fmt: skip
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        super().__init__(params, schedule, weight_decay)
        self._scratch2 = np.zeros_like(params)

    def prepare(self) -> None:
        t = self.iterations
        self._c1 = f32(1 - f32(self.beta_1) ** f32(t))
        self._c2 = f32(1 - f32(self.beta_2) ** f32(t))

    def update(self, g, w, s):
        a, u = self._scratch[s], self._scratch2[s]
        m, v = update_moments(self, g, s, self.beta_1, self.beta_2, a)
        np.divide(v, self._c2, out=a)
        np.sqrt(a, out=a)
        np.add(a, f32(self.epsilon), out=a)
        np.divide(m, self._c1, out=u)
        np.divide(u, a, out=u)
        w_norm = math.sqrt(float(np.dot(w, w)))
        u_norm = math.sqrt(float(np.dot(u, u)))
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        np.multiply(u, f32(ratio) * f32(self.lr), out=u)
        np.subtract(w, u, out=w)
