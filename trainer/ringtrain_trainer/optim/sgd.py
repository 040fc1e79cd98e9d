"""Keras ``SGD`` (momentum, nesterov), the update of ``keras/src/optimizers/sgd.py``::

momentum 0:  w -= lr * g
otherwise:   m = momentum * m - lr * g
             w += m                          (nesterov: w += momentum * m - lr * g)
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32


class SGD(Optimizer):
    name = "sgd"

    def __init__(self, params, schedule, momentum=0.0, nesterov=False, weight_decay=None):
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.state_names = ("momentum",) if self.momentum != 0 else ()
        super().__init__(params, schedule, weight_decay)

    def update(self, g, w, s):
        tmp = self._scratch[s]
        np.multiply(g, f32(self.lr), out=tmp)
        if "momentum" not in self.state:
            np.subtract(w, tmp, out=w)
            return
        m = self.state["momentum"][s]
        np.multiply(m, f32(self.momentum), out=m)
        np.subtract(m, tmp, out=m)
        if self.nesterov:
            np.subtract(w, tmp, out=w)
            np.multiply(m, f32(self.momentum), out=tmp)
            np.add(w, tmp, out=w)
        else:
            np.add(w, m, out=w)


class Momentum(SGD):
    """``--optimizer momentum``: Keras SGD(momentum=0.9), under its own name in checkpoints."""

    name = "momentum"

    def __init__(self, params, schedule, momentum=0.9, nesterov=False, weight_decay=None):
        super().__init__(params, schedule, momentum, nesterov, weight_decay)
