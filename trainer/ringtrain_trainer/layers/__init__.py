"""IPU layers for Keras models beyond the fused fast path: numpy, NHWC float32, in place.

Pipeline position: ``keras_model`` turns each validated Keras layer (``keras.config``) into one
of these through its ``keras.registry`` entry — or into ``fused.ConvPool`` / ``fused.Dense``
where the fast path fits — and
``engine.program.Program`` drives them all through one protocol: ``params(layer)``,
``state_specs``, ``buffers(batch, train, need_dx)``, ``flops``, ``bind(ws, batch)``,
``forward(ws, *inputs, **params)``, and backward in three parts —
``backward_local(ws, dout)`` (the gradient through the op's own activation or pooling, shared
by the two halves), ``backward_input(ws, dout, **params)`` (the input gradient; one per input
for a multi-input op such as ``Add``) and ``backward_weights(ws, dout, name, grad, rows)`` (one
row block of one parameter's gradient). Which half runs first, how a gradient is cut into
pieces (``engine.plan``) and when a piece is announced ready is the engine's decision, made once
for every op. Every buffer is allocated by the Program at
compile time; a training program is recognised by its training buffers (``dz``, ``mask``, ...),
so one class serves both kinds of program.

Dropout is deterministic: the mask of example ``e`` of the *global* batch (all workers, in
rank order) at step ``s`` comes from a Philox stream keyed by (``--seed``, layer) at counter
(``s``, ``e``). It depends on neither the number of workers nor of replicas or host threads,
so N workers with batch B draw exactly the masks of one worker with batch N·B. The Program's
``ctx`` dict (``seed``, ``step``, ``example0``: the global index of its first example) is set by
the IPU before each step.

BatchNormalization normalises with the statistics of each *replica's* batch in training, as
Keras does under MirroredStrategy without ``synchronized=True``; a replica's batch is never split
across host threads (the IPU runs it as one shard), so host threads do not change the numbers.
The moving mean and variance are non-trainable state, outside the flat parameter buffer and the
ring: each replica updates its copy, and after every step the worker's copies are averaged (how
Keras reads an ``ON_READ``/``MEAN`` variable). Workers keep their own; the chief's is what
checkpoints and exports carry.
"""

from ringtrain_trainer.layers.base import (
    Add,
    Dropout,
    Elementwise,
    Layer,
    Linear,
    Reshape,
    act_backward,
    act_forward,
    masks,
)
from ringtrain_trainer.layers.batchnorm import BatchNorm
from ringtrain_trainer.layers.conv import Conv2D, GlobalAvgPool2D, Pool2D, same_pad

__all__ = [
    "Add",
    "BatchNorm",
    "Conv2D",
    "Dropout",
    "Elementwise",
    "GlobalAvgPool2D",
    "Layer",
    "Linear",
    "Pool2D",
    "Reshape",
    "act_backward",
    "act_forward",
    "masks",
    "same_pad",
]
