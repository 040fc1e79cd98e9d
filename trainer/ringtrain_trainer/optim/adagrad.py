"""Keras ``Adagrad`` (initial_accumulator_value, epsilon), ``keras/src/optimizers/adagrad.py``::

acc += g*g                     (acc starts at initial_accumulator_value)
w -= lr * g / sqrt(acc + epsilon)
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class Adagrad(Optimizer):
    name = "adagrad"
    state_names = ("accumulator",)
    squares = True

    def __init__(
        self, params, schedule, initial_accumulator_value=0.1, epsilon=1e-7, weight_decay=None
    ):
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.epsilon = float(epsilon)
        super().__init__(params, schedule, weight_decay)
        self.state["accumulator"].fill(self.initial_accumulator_value)

    def update(self, g, w, s):
        acc, a = self.state["accumulator"][s], self._scratch[s]
        self.square(g, s, out=a)
        np.add(acc, a, out=acc)
        np.add(acc, f32(self.epsilon), out=a)
        np.sqrt(a, out=a)
        np.divide(g, a, out=a)
        np.multiply(a, f32(self.lr), out=a)
        np.subtract(w, a, out=w)
