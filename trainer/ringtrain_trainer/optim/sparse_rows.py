"""Keras' second moments for an Embedding table: the sum of each occurrence's squared gradient.

Keras 3 (TensorFlow backend) gets an Embedding's gradient as ``tf.IndexedSlices`` with one
slice per token occurrence, duplicate ids unsummed. Adam's, RMSprop's and Adagrad's
``ops.square(gradient)`` squares each slice (``sparse.elementwise_unary``) and only then are
the duplicates summed into the dense moment: a row read ``k`` times gets ``Σ g_i²``, not the
``(Σ g_i)²`` of the summed gradient. The first moment and the update itself use ``Σ g_i``
(dense), and every row's moments still decay (``v += (sq - v)(1 - beta_2)`` is dense), so the
update is not "lazy": only the squared term differs. Measured on the zoo's models (one step,
batch 16): Keras' weights are the sum-of-squares rule within 3e-7, and 2.5e-2 (Adam) /
3.4e-2 (RMSprop) from the square-of-sum rule.

:class:`SparseRows` computes that term for each Embedding table of the model: after backward,
from the op's per-occurrence gradients (``ws["gathered"]``, sorted by id in ``ws["sorted"]``),
scaled to the global batch's mean loss (a program's ``dout`` is of its own mean, so times
``program batch / global batch``), summed over the worker's programs and then over every
worker (allreduce of the mean, times the world size): the occurrences of the *global* batch,
the same on every worker and the same as one worker with the whole batch. The optimizer then
reads it in place of ``g * g`` for those rows (:meth:`Optimizer.square`), and the reducer's
hook applies those rows only once it is ready (:meth:`OptimizerHook.apply_deferred`).
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.embedding import Embedding


class SparseRows:
    """The flat ranges of a model's Embedding tables and one buffer of their ``Σ g_i²``."""

    def __init__(self, spec, dtype=np.float32):
        self.tables = [
            (i, s.start, s.stop)
            for s in spec.slots
            for i in [s.spec.layer]
            if isinstance(spec.layers[i], Embedding)
            and s.spec.name == "embeddings"
            # a regularized table's gradient is dense in Keras (the penalty's gradient is added
            # to the IndexedSlices, summing duplicate ids first): squared like any other
            and s.spec.reg is None
        ]
        self.ranges = [(a, b) for _, a, b in self.tables]
        self.buffer = np.zeros(sum(b - a for a, b in self.ranges), dtype)
        self.views: dict[int, np.ndarray] = {}
        off = 0
        for a, b in self.ranges:
            self.views[a] = self.buffer[off : off + b - a]
            off += b - a

    def __bool__(self) -> bool:
        return bool(self.tables)

    def gather(self, spec, programs, global_batch: int) -> None:
        """This worker's share: each program's occurrences, squared, scaled to the global mean
        and summed into their rows (arrays of the batch's size, none of the table's)."""
        self.buffer.fill(0)
        for i, a, _ in self.tables:
            rows = self.views[a].reshape(-1, spec.layers[i].output_dim)
            for p in programs:
                ws = p.ws[i]
                g = ws["gathered"]
                scale = g.dtype.type(p.batch / global_batch)
                sq = np.multiply(g, scale)
                np.multiply(sq, sq, out=sq)
                ids = ws["sorted"]  # ascending: one reduceat per run of equal ids
                starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
                rows[ids[starts]] += np.add.reduceat(sq, starts, axis=0)

    def reduce(self, collective, step: int, tag: int) -> None:
        """The global batch's sums: the same on every worker."""
        if collective.size > 1:
            collective.allreduce_mean_(self.buffer, step=step, tag=tag)
            np.multiply(self.buffer, self.buffer.dtype.type(collective.size), out=self.buffer)
