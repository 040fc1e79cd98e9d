"""Host-side optimizers with TensorFlow/Keras defaults and update formulas.

Pipeline position: the reducer's on-reduced hook (``reducer.hook``, the only caller) begins
each step and calls :meth:`Optimizer.apply` on a contiguous slice of the flat parameter buffer
as soon as that slice's reduced gradient is ready, so updating the last layers overlaps with
backward and communication of the first ones. State (momentum, Adam's m and v) lives only in host memory, in flat buffers with the same layout as the parameters, so a
slice of parameters maps to the same slice of state. All updates are in-place numpy ufuncs
into a preallocated scratch buffer: nothing is allocated per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import InvalidSpec

OPTIMIZERS = ("sgd", "momentum", "adam")


@dataclass(frozen=True)
class StepDecay:
    """lr * decay ** (epoch // every_epochs); decay 1.0 is a constant rate."""

    lr: float = 1e-3
    decay: float = 1.0
    every_epochs: int = 1

    def __call__(self, epoch: int) -> float:
        return self.lr * self.decay ** (epoch // max(1, self.every_epochs))


class Optimizer:
    """Base: the flat parameter buffer, per-step state, and the ``apply(start, stop)`` contract.

    ``begin_step(epoch)`` is called once per step before any ``apply``; ``apply`` may then run on
    the communication thread for disjoint slices while the IPU still computes.
    """

    name = "base"
    state_names: tuple[str, ...] = ()

    def __init__(self, params: np.ndarray, schedule: StepDecay):
        self.params = params
        self.schedule = schedule
        self.iterations = 0
        self.lr = schedule(0)
        self.state = {k: np.zeros_like(params) for k in self.state_names}
        self._scratch = np.zeros_like(params)

    @property
    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())

    def begin_step(self, epoch: int) -> None:
        self.lr = self.schedule(epoch)
        self.iterations += 1

    def apply(self, grads: np.ndarray, start: int, stop: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        return dict(self.state)

    def load_state(self, state: dict[str, np.ndarray], iterations: int) -> None:
        for k in self.state_names:
            if k not in state:
                raise KeyError(f"optimizer state {k!r} missing")
            np.copyto(self.state[k], state[k])
        self.iterations = iterations


class SGD(Optimizer):
    """Keras SGD: ``w -= lr * g``."""

    name = "sgd"

    def apply(self, grads, start, stop):
        s = slice(start, stop)
        tmp = self._scratch[s]
        np.multiply(grads[s], np.float32(self.lr), out=tmp)
        np.subtract(self.params[s], tmp, out=self.params[s])


class Momentum(Optimizer):
    """Keras SGD(momentum=0.9): ``m = momentum*m - lr*g; w += m``."""

    name = "momentum"
    state_names = ("momentum",)

    def __init__(self, params, schedule, momentum: float = 0.9):
        super().__init__(params, schedule)
        self.momentum = momentum

    def apply(self, grads, start, stop):
        s = slice(start, stop)
        m, tmp = self.state["momentum"][s], self._scratch[s]
        np.multiply(m, np.float32(self.momentum), out=m)
        np.multiply(grads[s], np.float32(self.lr), out=tmp)
        np.subtract(m, tmp, out=m)
        np.add(self.params[s], m, out=self.params[s])


class Adam(Optimizer):
    """tf.keras Adam (beta1 0.9, beta2 0.999, epsilon 1e-7), the "epsilon hat" form::

    alpha = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
    m += (g - m) * (1 - beta1);  v += (g*g - v) * (1 - beta2)
    w -= alpha * m / (sqrt(v) + epsilon)
    """

    name = "adam"
    state_names = ("m", "v")

    def __init__(self, params, schedule, beta1=0.9, beta2=0.999, epsilon=1e-7):
        super().__init__(params, schedule)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self._scratch2 = np.zeros_like(params)
        self.alpha = 0.0

    def begin_step(self, epoch):
        super().begin_step(epoch)
        t = self.iterations
        self.alpha = self.lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)

    def apply(self, grads, start, stop):
        s = slice(start, stop)
        g, w = grads[s], self.params[s]
        m, v, a, b = self.state["m"][s], self.state["v"][s], self._scratch[s], self._scratch2[s]
        f = np.float32
        np.subtract(g, m, out=a)
        np.multiply(a, f(1 - self.beta1), out=a)
        np.add(m, a, out=m)
        np.multiply(g, g, out=a)
        np.subtract(a, v, out=a)
        np.multiply(a, f(1 - self.beta2), out=a)
        np.add(v, a, out=v)
        np.sqrt(v, out=b)
        np.add(b, f(self.epsilon), out=b)
        np.multiply(m, f(self.alpha), out=a)
        np.divide(a, b, out=a)
        np.subtract(w, a, out=w)


def build(name: str, params: np.ndarray, schedule: StepDecay) -> Optimizer:
    if name == "sgd":
        return SGD(params, schedule)
    if name == "momentum":
        return Momentum(params, schedule)
    if name == "adam":
        return Adam(params, schedule)
    raise InvalidSpec(f"--optimizer: unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")


def state_bytes_for(name: str, num_params: int, itemsize: int = 4) -> int:
    """Bytes of optimizer state for a model size (the IPU's plan when state is on the device)."""
    per = {"sgd": 0, "momentum": 1, "adam": 2}
    if name not in per:
        raise InvalidSpec(f"--optimizer: unknown optimizer {name!r}")
    return per[name] * num_params * itemsize
