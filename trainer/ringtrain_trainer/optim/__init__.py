"""Host-side optimizers with Keras' formulas, arguments and defaults.

Pipeline position: between the reducer (which hands each reduced gradient slice to
:meth:`Optimizer.apply`) and the flat parameter buffer. One module per concept: :mod:`.base`
(the contract, weight decay), :mod:`.clip` (clipping the reduced gradient), one module per
optimizer family, :mod:`.schedules` (learning-rate schedules) and :mod:`.registry` (which
optimizer runs: the model's ``compile_config`` or the flags, refusing what is unsupported).
"""

from __future__ import annotations

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.optim.adagrad import Adagrad
from ringtrain_trainer.optim.adam import Adam, AdamW
from ringtrain_trainer.optim.base import Optimizer
from ringtrain_trainer.optim.registry import (
    FLAGS,
    OptimizerSpec,
    check_resume,
    for_run,
    from_compile_config,
    resolve,
    state_arrays,
)
from ringtrain_trainer.optim.registry import build as build_spec
from ringtrain_trainer.optim.rmsprop import RMSprop
from ringtrain_trainer.optim.schedules import StepDecay
from ringtrain_trainer.optim.sgd import SGD, Momentum
from ringtrain_trainer.optim.sparse_rows import SparseRows

#: ``--optimizer`` choices: the registry's flags (ringtrain.options' table must list the same)
OPTIMIZERS = tuple(FLAGS)

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Momentum",
    "Optimizer",
    "OptimizerSpec",
    "RMSprop",
    "StepDecay",
    "build",
    "build_spec",
    "check_resume",
    "for_model",
    "for_run",
    "from_compile_config",
    "resolve",
    "state_arrays",
    "state_bytes_for",
]


def build(name: str, params: np.ndarray, schedule: StepDecay) -> Optimizer:
    """``--optimizer NAME`` with ``schedule``: the built-in models' optimizers."""
    if name == "sgd":
        return SGD(params, schedule)
    if name == "momentum":
        return Momentum(params, schedule)
    if name == "adam":
        return Adam(params, schedule)
    raise InvalidSpec(f"--optimizer: unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")


def state_bytes_for(name: str | OptimizerSpec, num_params: int, itemsize: int = 4) -> int:
    """Bytes of optimizer state for a model size (the IPU's plan when state is on the device)."""
    if not isinstance(name, OptimizerSpec):
        if name not in FLAGS:
            raise InvalidSpec(f"--optimizer: unknown optimizer {name!r}")
        name = resolve(None, name)
    return state_arrays(name) * num_params * itemsize


def for_model(spec: OptimizerSpec, model, params: np.ndarray) -> Optimizer:
    """The optimizer ``spec`` over ``model``'s flat ``params``, with what the model adds:
    per-tensor clipping, Adafactor's factored shapes, the weight regularizers and constraints,
    and an Embedding's sparse rows (Keras' squared gradient of a row: the sum over its
    occurrences)."""
    slots = model.slots
    opt = build_spec(spec, params, [(s.start, s.stop) for s in slots])  # clipnorm: per tensor
    if opt.whole_tensors:  # Adafactor: its moments factor Keras' shapes
        opt.set_shapes(model.keras_shapes())
    opt.set_regularizers([(s.start, s.stop, s.spec.reg) for s in slots if s.spec.reg is not None])
    opt.set_constraints([(s.start, s.stop, s.spec.constraint) for s in slots if s.spec.constraint])
    opt.set_sparse(SparseRows(model, params.dtype))
    return opt
