"""Keras ``Adafactor`` (``keras/src/optimizers/adafactor.py``), per weight tensor::

    t = iterations + 1;  lr = min(lr, 1/sqrt(t)) if relative_step and lr is a number
    rho = min(lr, 1/sqrt(t));  alpha = max(epsilon_2, rms(w)) * rho
    s = g² + epsilon_1;  beta = 1 - t**beta_2_decay
    rank >= 2:  r = beta r + (1-beta) mean(s, -1);  c = beta c + (1-beta) mean(s, -2)
                v = (r / mean(r, -1))[..., None] * c[..., None, :]
    rank < 2:   v = beta v + (1-beta) s
    u = g / sqrt(v);  w -= alpha * u / max(1, rms(u) / clip_threshold)

Why a tensor at a time: the factored moments ``r`` and ``c`` are means over a tensor's last two
axes of Keras' own shape and ``rms`` is over the whole tensor, so an update needs the whole
reduced tensor (the reducer's pieces may cut one anywhere): :class:`.clip.Clip` hands it over
when its last piece arrives, as for ``clipnorm``. The factored state is ``r`` and ``c`` (rows +
columns), as small as Keras keeps it; a rank-1 tensor's ``v`` is a full slot. They live in one
flat ``factored`` buffer laid out per tensor, so checkpoints carry it like Adam's moments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ringtrain_trainer.optim.base import Optimizer, f32
from ringtrain_trainer.optim.schedules import KerasSchedule


class Adafactor(Optimizer):
    name = "adafactor"
    whole_tensors = True

    def __init__(
        self, params, schedule, beta_2_decay=-0.8, epsilon_1=1e-30, epsilon_2=1e-3,
        clip_threshold=1.0, relative_step=True, weight_decay=None,
    ):  # fmt: skip
        self.beta_2_decay, self.epsilon_1 = float(beta_2_decay), float(epsilon_1)
        self.epsilon_2, self.clip_threshold = float(epsilon_2), float(clip_threshold)
        self.relative_step = bool(relative_step)
        self.state_names = ("factored",)
        super().__init__(params, schedule, weight_decay)
        #: tensor start → (Keras shape, offset of its state in ``factored``)
        self.tensors: dict[int, tuple[tuple[int, ...], int]] = {}
        self.set_shapes([(0, params.size, (params.size,))])

    def set_shapes(self, tensors: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        """Each weight tensor's range and Keras shape (``KerasModel.keras_shapes``): the axes
        the factored moments average over. The state buffer is sized for them, once."""
        self.tensors, offset = {}, 0
        for start, stop, shape in sorted(tensors):
            assert math.prod(shape) == stop - start, (start, stop, shape)
            self.tensors[int(start)] = (tuple(shape), offset)
            offset += _state_size(tuple(shape))
        self.state["factored"] = np.zeros(offset, self.params.dtype)

    def prepare(self) -> None:
        t = float(self.iterations)  # Keras' iterations + 1: this module's doc
        lr = self.lr
        if self.relative_step and not isinstance(self.schedule, KerasSchedule):
            lr = min(lr, 1 / math.sqrt(t))
        self._rho = f32(min(f32(lr), f32(1 / math.sqrt(t))))
        self._beta = f32(1 - f32(t) ** f32(self.beta_2_decay))

    def update(self, g, w, s):
        shape, at = self.tensors[s.start]
        state = self.state["factored"]
        beta, one_minus = self._beta, f32(1) - self._beta
        rms_w = _rms(w)
        alpha = f32(max(f32(self.epsilon_2), f32(rms_w))) * self._rho
        sq = self._scratch[s]
        np.multiply(g, g, out=sq)
        np.add(sq, f32(self.epsilon_1), out=sq)
        if len(shape) >= 2:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            lead = math.prod(shape[:-2])
            r = state[at : at + rows].reshape(shape[:-1])
            c = state[at + rows : at + rows + lead * cols].reshape((*shape[:-2], cols))
            s3 = sq.reshape(shape)
            r *= beta
            r += one_minus * np.mean(s3, axis=-1, dtype=np.float32)
            c *= beta
            c += one_minus * np.mean(s3, axis=-2, dtype=np.float32)
            v = s3  # g² is no longer needed: v takes its place
            np.multiply((r / np.mean(r, axis=-1, keepdims=True))[..., None], c[..., None, :], out=v)
        else:
            v = state[at : at + w.size]
            v *= beta
            np.multiply(sq, one_minus, out=sq)
            v += sq
        u = sq  # v (rank >= 2) or g² (rank 1) is read once more, then u takes its buffer
        np.divide(g, np.sqrt(v.reshape(-1)), out=u)
        rms_u = _rms(u)
        scale = alpha / f32(max(1.0, float(f32(rms_u) / f32(self.clip_threshold))))
        np.multiply(u, f32(scale), out=u)
        np.subtract(w, u, out=w)


def _rms(x: np.ndarray) -> float:
    """Root mean square without a temporary (a BLAS dot in float32)."""
    return math.sqrt(float(np.dot(x, x)) / x.size)


def _state_size(shape: tuple[int, ...]) -> int:
    """``r`` + ``c`` for a matrix-like tensor (Keras' factored moments), ``v`` otherwise."""
    if len(shape) >= 2:
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    return math.prod(shape)
