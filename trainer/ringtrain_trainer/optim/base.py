"""The host-side optimizer's contract: flat state, ``begin_step`` then ``apply(start, stop)``.

Pipeline position: the reducer's on-reduced hook (``reducer.hook``, the only caller) begins
each step and calls :meth:`Optimizer.apply` on a contiguous slice of the flat parameter buffer
as soon as that slice's reduced gradient is ready, so updating the last layers overlaps with
backward and communication of the first ones. State (momentum, Adam's m and v) lives only in
host memory, in flat buffers with the same layout as the parameters, so a slice of parameters
maps to the same slice of state. All updates are in-place numpy ufuncs into preallocated
scratch buffers: nothing is allocated per step.

Each step follows Keras' ``BaseOptimizer.apply``: the learning rate is the schedule's value at
``iterations`` (the count *before* this step, Keras' ``optimizer.iterations``), the reduced
gradient (with the weight regularizers' gradient added, :meth:`Optimizer.set_regularizers`)
is clipped (:mod:`.clip`), decoupled weight decay ``w -= w * wd * lr`` runs before the
update, and ``iterations`` then counts this step (Adam's bias correction uses the new count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ringtrain_trainer.engine import native
from ringtrain_trainer.optim.clip import Clip
from ringtrain_trainer.optim.constraints import Constraint, Tracker

f32 = np.float32


class Schedule(Protocol):
    """A learning rate per step: Keras schedules read the iteration, the CLI's step decay the
    epoch."""

    def value(self, iteration: int, epoch: int) -> float: ...


class Constant:
    def __init__(self, lr: float):
        self.lr = float(lr)

    def value(self, iteration: int, epoch: int) -> float:
        return self.lr

    def __call__(self, step: int) -> float:
        return self.lr


class Optimizer:
    """Base: the flat parameter buffer, per-step state, and the ``apply(start, stop)`` contract.

    ``begin_step(epoch)`` is called once per step before any ``apply``; ``apply`` may then run on
    the communication thread for disjoint slices while the IPU still computes. Subclasses
    implement :meth:`update` on one slice; clipping and weight decay are done here.
    """

    name = "base"
    state_names: tuple[str, ...] = ()

    def __init__(self, params: np.ndarray, schedule, weight_decay: float | None = None):
        self.params = params
        self.schedule = schedule if hasattr(schedule, "value") else Constant(schedule)
        self.weight_decay = weight_decay or None
        self.iterations = 0
        self.lr = float(self.schedule.value(0, 0))
        self.state = {k: np.zeros_like(params) for k in self.state_names}
        self._scratch = np.zeros_like(params)
        self.clip = Clip(None, 0.0, [(0, params.size)])
        #: (start, stop, regularizer) of the regularized tensors (``set_regularizers``)
        self.regs: list[tuple[int, int, Any]] = []
        #: this step's regularization penalty: what the reported loss adds, as Keras' does
        self.penalty = 0.0
        #: Embedding tables whose squared gradient is Keras' per-occurrence sum (see
        #: :mod:`.sparse_rows`); set by :meth:`set_sparse` when the update squares ``g``
        self.sparse = None
        #: host threads a compiled elementwise update may split a large slice over (the
        #: IPU's host threads, set by the worker; the update is elementwise: no bit changes)
        self.threads = 1
        self.constraints: Tracker | None = None
        #: Keras' ``use_ema``: (ema_momentum, ema_overwrite_frequency), set by :meth:`set_ema`
        self.ema: tuple[np.float32, int | None] | None = None

    @property
    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())

    #: whether :meth:`update` needs a whole weight tensor at once (Adafactor's factored moments)
    whole_tensors = False

    def set_clip(self, clip: Clip) -> None:
        self.clip = clip

    def set_shapes(self, tensors: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        """Each weight tensor's range and Keras shape: read only by an optimizer whose update
        works on a whole tensor's axes (:attr:`whole_tensors`)."""

    def set_regularizers(self, regs: Sequence[tuple[int, int, Any]]) -> None:
        """Keras' ``kernel_regularizer`` & co. on ranges of the flat buffer. Every replica's
        loss carries the whole penalty, so the replicas' mean gradient carries its gradient
        once: :meth:`apply` adds it once to the reduced gradient, before clipping (Keras
        clips the gradient of the loss that includes the penalty)."""
        self.regs = sorted(((int(a), int(b), r) for a, b, r in regs), key=lambda t: t[0])

    def set_constraints(self, ranges: Sequence[tuple[int, int, Constraint]]) -> None:
        """Keras' ``kernel_constraint`` & co. on ranges of the flat buffer: each tensor is
        projected once its last slice of the step is updated (:mod:`.constraints`)."""
        self.constraints = Tracker(list(ranges)) if ranges else None

    def set_ema(self, momentum: float, overwrite_every: int | None) -> None:
        """Keras' ``use_ema``: an exponential moving average of the weights kept beside them
        (``average``: one more flat state buffer, so checkpoints and the ring's broadcast carry
        it like Adam's moments), updated after each slice's update and before its constraint,
        as ``BaseOptimizer._backend_apply_gradients`` does; every ``overwrite_every`` steps the
        weights take the average, and :meth:`finalize` gives them it at the end of training."""
        self.ema = (f32(momentum), overwrite_every)
        self.state_names = (*self.state_names, "average")
        self.state["average"] = np.zeros_like(self.params)

    def finalize(self) -> None:
        """Keras' ``finalize_variable_values`` (what ``fit`` calls when training ends): with
        ``use_ema`` the weights become their moving average; otherwise nothing."""
        if self.ema is not None:
            np.copyto(self.params, self.state["average"])

    def _average(self, s: slice) -> None:
        assert self.ema is not None
        momentum, every = self.ema
        avg, w, tmp = self.state["average"][s], self.params[s], self._scratch[s]
        m = momentum if self.iterations > 1 else f32(0.0)  # Keras: iterations != 0 before +1
        np.multiply(avg, m, out=avg)
        np.multiply(w, f32(1.0) - m, out=tmp)
        np.add(avg, tmp, out=avg)
        if every and self.iterations % every == 0:
            np.copyto(w, avg)

    #: whether :meth:`update` squares the gradient (Adam, RMSprop, Adagrad): only then do an
    #: Embedding's duplicate ids change the update (:mod:`.sparse_rows`)
    squares = False

    def set_sparse(self, rows) -> None:
        if self.squares and rows:
            self.sparse = rows

    def square(self, g: np.ndarray, s: slice, out: np.ndarray) -> None:
        """``out = g * g``, except on Embedding rows: the sum of each occurrence's square."""
        np.multiply(g, g, out=out)
        if self.sparse is None:
            return
        for a, b in self.sparse.ranges:
            lo, hi = max(a, s.start), min(b, s.stop)
            if lo < hi:
                out[lo - s.start : hi - s.start] = self.sparse.views[a][lo - a : hi - a]

    def begin_step(self, epoch: int) -> None:
        p, tmp = self.params, self._scratch
        # the weights this step's forward reads, before any slice is updated
        self.penalty = sum(r.loss(p[a:b], tmp[a:b]) for a, b, r in self.regs)
        self.lr = float(self.schedule.value(self.iterations, epoch))
        self.iterations += 1
        self.clip.begin_step()
        if self.constraints is not None:
            self.constraints.begin_step()
        self.prepare()

    def prepare(self) -> None:
        """Per-step scalars (Adam's bias correction), after ``iterations`` counts this step."""

    def apply(self, grads: np.ndarray, start: int, stop: int) -> None:
        """``grads[start:stop]`` is reduced: clip it and update what is now complete (with
        clipnorm a whole tensor, with global_clipnorm the whole gradient; see :mod:`.clip`).
        Denormals are flushed to zero, as Keras' optimizers run in TensorFlow."""
        with native.flushed_denormals():
            self._apply(grads, start, stop)

    def _apply(self, grads: np.ndarray, start: int, stop: int) -> None:
        for a, b, r in self.regs:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                r.add_grad(self.params[lo:hi], grads[lo:hi], self._scratch[lo:hi])
        for a, b in self.clip.ready(grads, start, stop):
            s = slice(a, b)
            if self.weight_decay:
                w, tmp = self.params[s], self._scratch[s]
                np.multiply(w, f32(self.weight_decay) * f32(self.lr), out=tmp)
                np.subtract(w, tmp, out=w)
            self.update(grads[s], self.params[s], s)
            if self.ema is not None:
                self._average(s)
            if self.constraints is not None:
                for lo, hi, c in self.constraints.applied(a, b):
                    c.project(self.params[lo:hi], self._scratch[lo:hi])

    def update(self, g: np.ndarray, w: np.ndarray, s: slice) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        return dict(self.state)

    def load_state(self, state: dict[str, np.ndarray], iterations: int) -> None:
        for k in self.state_names:
            if k not in state:
                raise KeyError(f"optimizer state {k!r} missing")
            np.copyto(self.state[k], state[k])
        self.iterations = iterations
