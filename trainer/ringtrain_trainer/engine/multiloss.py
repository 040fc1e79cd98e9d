"""Several outputs, several losses: Keras' weighted sum over the model's outputs; numpy only.

Why packed: the IPU, the data pipeline, the ring and the evaluators move one ``x`` and one
``y`` per batch. A model with several outputs keeps that contract: its program writes every
output, side by side, into one ``(batch, sum of widths)`` buffer, and its labels arrive as one
float32 ``(batch, sum of label widths)`` buffer (class ids as one exact float column, below
2**24). :class:`MultiLoss` cuts both per output and runs each output's own
:class:`~.losses.Loss` on its slice.

The total is what Keras 3 computes (``CompileLoss``): ``sum_j loss_weights[j] * loss_j``, each
``loss_j`` reduced ``sum_over_batch_size`` on its own; an output compiled with loss None adds
nothing and gets a zero gradient (Keras computes no gradient from it). dloss/doutput of output
``j`` is ``loss_weights[j] * dloss_j``, written into its own contiguous block of :attr:`grad`
so each block can be handed to the graph as that output tensor's gradient without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringtrain_trainer.engine import losses
from ringtrain_trainer.engine.loss_spec import LossSpec
from ringtrain_trainer.engine.losses import Loss


@dataclass(frozen=True)
class Head:
    """One model output: its Keras name, its loss (None: not trained from), loss weight,
    width (the output's units) and the metrics compiled for it (Keras' names)."""

    name: str
    loss: LossSpec | None
    weight: float
    width: int
    metrics: tuple[str, ...] = ()

    @property
    def label_width(self) -> int:
        """Columns of the packed labels: one for class ids, the output's width otherwise."""
        if self.loss is None:
            return 0
        return 1 if self.loss.kind == "sparse" else self.width

    @property
    def trained_loss(self) -> LossSpec:
        """The loss of a head trained from (``MultiLossSpec.trained``)."""
        assert self.loss is not None, f"output {self.name} is not trained from"
        return self.loss


@dataclass(frozen=True)
class MultiLossSpec:
    """The compiled losses of a model with several outputs, in the model's output order."""

    heads: tuple[Head, ...]
    name: str = "MultiOutput"
    folded: str | None = None

    kind = "multi"

    def arg(self, key: str):
        return None

    @property
    def metric(self) -> str:
        """The one metric ``test_accuracy`` / ``test_mae`` carries: the first trained
        output's (every output's is reported by name, ``named_eval``)."""
        return self.trained[0].trained_loss.metric

    @property
    def widths(self) -> list[int]:
        return [h.width for h in self.heads]

    @property
    def label_widths(self) -> list[int]:
        return [h.label_width for h in self.heads]

    @property
    def trained(self) -> list[Head]:
        return [h for h in self.heads if h.loss is not None]

    def describe(self) -> str:
        parts = [
            f"{h.name}: {h.weight:g} × {h.loss.describe() if h.loss else 'None'}"
            for h in self.heads
        ]
        return "{" + ", ".join(parts) + "}"

    def keras(self) -> dict:
        """``compile_config.loss`` as a dict keyed by output name (None where untrained)."""
        return {h.name: h.loss.keras() if h.loss else None for h in self.heads}

    def keras_weights(self) -> dict:
        return {h.name: h.weight for h in self.heads}

    def record(self) -> dict:
        return {
            "keras": self.keras(),
            "loss_weights": self.keras_weights(),
            "describe": self.describe(),
        }

    def log_names(self) -> list[str]:
        """Keras' history keys for the per-output losses: ``<output>_loss``."""
        return [f"{h.name}_loss" for h in self.trained]

    def named(self, parts) -> dict[str, float]:
        """A step's ``MultiLoss.parts`` by Keras' names: ``<output>_loss`` for every trained
        output, ``<output>_accuracy`` / ``<output>_mae`` where that output compiled a metric."""
        heads, k = self.trained, len(self.trained)
        out = {f"{h.name}_loss": round(float(parts[i]), 6) for i, h in enumerate(heads)}
        for i, h in enumerate(heads):
            if h.metrics:
                out[f"{h.name}_{h.trained_loss.metric}"] = round(float(parts[k + i]), 6)
        return out

    def named_eval(self, sums, n: int) -> dict[str, float]:
        """``ipu.eval_sums`` over ``n`` examples as Keras names them: ``<output>_loss`` and
        ``<output>_accuracy`` / ``<output>_mae`` (the metric its loss reports)."""
        heads, k = self.trained, len(self.trained)
        out = {}
        for i, h in enumerate(heads):
            out[f"{h.name}_loss"] = round(float(sums[i]) / max(1, n), 6)
            out[f"{h.name}_{h.trained_loss.metric}"] = round(float(sums[k + i]) / max(1, n), 6)
        return out


def label_buffer(spec: MultiLossSpec, batch: int, dtype=np.float32) -> np.ndarray:
    return np.zeros((batch, sum(spec.label_widths)), dtype)


def buffer_bytes(spec: MultiLossSpec, batch: int, itemsize: int = 4) -> tuple[int, int]:
    """(labels, workspace) bytes: the packed labels and output, and every head's own loss."""
    labels = batch * sum(spec.label_widths) * itemsize
    work = 2 * batch * sum(spec.widths) * itemsize  # packed output, packed gradient
    for h in spec.trained:
        lb, w = losses.buffer_bytes(h.trained_loss, batch, h.width, itemsize)
        work += lb + w
    return labels, work


class MultiLoss:
    """The packed counterpart of :class:`~.losses.Loss`: same ``labels`` / ``grad`` /
    ``step`` / ``total`` / ``score`` contract on packed rows; :attr:`parts` holds each trained
    output's last unweighted loss (what ``<output>_loss`` reports), then its batch metric."""

    def __init__(self, spec: MultiLossSpec, batch: int, dtype=np.float32):
        self.spec, self.batch, self.dtype = spec, batch, np.dtype(dtype)
        self.labels = label_buffer(spec, batch, self.dtype)
        k = sum(spec.widths)
        self._flat = np.zeros(batch * k, self.dtype)
        #: dloss/doutput of every output, each one contiguous block (shape for elementwise use)
        self.grad = self._flat.reshape(batch, k)
        self.blocks: list[np.ndarray] = []
        self.cols: list[tuple[int, int]] = []
        self.lcols: list[tuple[int, int]] = []
        self.subs: list[Loss | None] = []
        at = lat = 0
        for h in spec.heads:
            block = self._flat[batch * at : batch * (at + h.width)].reshape(batch, h.width)
            self.blocks.append(block)
            self.cols.append((at, at + h.width))
            self.lcols.append((lat, lat + h.label_width))
            at, lat = at + h.width, lat + h.label_width
            sub = None if h.loss is None else Loss(h.loss, batch, h.width, dtype)
            if sub is not None:
                sub.grad = block
            self.subs.append(sub)
        #: per trained output its last loss, then its last batch metric (mean over the rows)
        self.parts = np.zeros(2 * len(spec.trained))

    def _labels_into(self, sub: Loss, y: np.ndarray) -> None:
        if sub.labels.ndim == 1:
            np.copyto(sub.labels, y[:, 0], casting="unsafe")
        else:
            np.copyto(sub.labels, y)

    def step(self, z: np.ndarray) -> float:
        total, n = 0.0, 0
        for h, sub, (a, b), (la, lb) in zip(
            self.spec.heads, self.subs, self.cols, self.lcols, strict=True
        ):
            if sub is None:
                continue
            self._labels_into(sub, self.labels[:, la:lb])
            part = sub.step(z[:, a:b])
            if h.weight != 1.0:
                np.multiply(sub.grad, self.dtype.type(h.weight), out=sub.grad)
            if h.metrics:
                self.parts[len(self.parts) // 2 + n] = sub.score(z[:, a:b], sub.labels) / self.batch
            self.parts[n], n = part, n + 1
            total += h.weight * part
        return total

    # -- evaluation: whole packed rows, float64 ----------------------------------------------
    def _each(self, z: np.ndarray, y: np.ndarray):
        for h, sub, (a, b), (la, lb) in zip(
            self.spec.heads, self.subs, self.cols, self.lcols, strict=True
        ):
            if sub is not None:
                yv = y[:, la:lb]
                if h.trained_loss.kind == "sparse":
                    yv = np.asarray(yv[:, 0], np.int64)
                yield h, sub, z[:, a:b], yv

    def totals(self, z: np.ndarray, y: np.ndarray) -> list[float]:
        """Each trained output's summed loss over the rows."""
        return [sub.total(zv, yv) for _, sub, zv, yv in self._each(z, y)]

    def scores(self, z: np.ndarray, y: np.ndarray) -> list[float]:
        """Each trained output's summed metric (accuracy or absolute error) over the rows."""
        return [sub.score(zv, yv) for _, sub, zv, yv in self._each(z, y)]

    def total(self, z: np.ndarray, y: np.ndarray) -> float:
        heads = self.spec.trained
        return sum(h.weight * t for h, t in zip(heads, self.totals(z, y), strict=True))

    def score(self, z: np.ndarray, y: np.ndarray) -> float:
        """The first trained output's summed metric (``MultiLossSpec.metric``); every
        output's comes from :meth:`scores`."""
        return self.scores(z, y)[0]


# -- one output or several: what programs, the worker and the memory plan call ---------------
def make_loss(spec, batch: int, k: int, dtype=np.float32):
    """One output's :class:`~.losses.Loss`, or the packed :class:`MultiLoss`."""
    if isinstance(spec, MultiLossSpec):
        return MultiLoss(spec, batch, dtype)
    return Loss(spec, batch, k, dtype)


def labels_for(spec, batch: int, k: int, dtype=np.float32) -> np.ndarray:
    if isinstance(spec, MultiLossSpec):
        return label_buffer(spec, batch, dtype)
    return losses.label_buffer(spec, batch, k, dtype)


def loss_bytes(spec, batch: int, k: int, itemsize: int = 4) -> tuple[int, int]:
    if isinstance(spec, MultiLossSpec):
        return buffer_bytes(spec, batch, itemsize)
    return losses.buffer_bytes(spec, batch, k, itemsize)
