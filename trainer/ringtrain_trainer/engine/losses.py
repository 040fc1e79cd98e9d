"""The loss registry: Keras loss class name → one entry, its value and its gradient with respect
to the model's output side by side, used by training, the worker's evaluation and the Evaluator.

Pipeline position: ``keras.compile.read`` calls :func:`parse` on ``compile_config.loss`` (refusing
what is unsupported, naming the field, before anything runs); ``engine.program.Program`` builds
one :class:`Loss` per compiled program (labels, gradient and workspace allocated once; a training
step allocates nothing) and the evaluators call :meth:`Loss.total` / :meth:`Loss.score` on whole
batches. Numpy only.

A final ``softmax`` (categorical losses) or ``sigmoid`` (binary cross-entropy) is folded into the
loss, as Keras' TensorFlow backend does (its ``_keras_logits``): the program's output is then the
logits and the entry computes the loss from them, stable and exact. Every entry reduces with
``sum_over_batch_size``: the per-example loss (a mean over the output's last axis for the
element-wise losses) summed and divided by the batch size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import loss_fns

WHERE = "compile_config.loss"

#: Keras class name → (its string aliases, kind, the accepted config keys and their defaults)
_ENTRIES: dict[str, tuple[tuple[str, ...], str, dict]] = {
    "SparseCategoricalCrossentropy": (
        ("sparse_categorical_crossentropy",),
        "sparse",
        {"from_logits": False, "ignore_class": None},
    ),
    "CategoricalCrossentropy": (
        ("categorical_crossentropy",),
        "categorical",
        {"from_logits": False, "label_smoothing": 0.0, "axis": -1},
    ),
    "BinaryCrossentropy": (
        ("binary_crossentropy",),
        "binary",
        {"from_logits": False, "label_smoothing": 0.0, "axis": -1},
    ),
    "MeanSquaredError": (("mean_squared_error", "mse"), "regression", {}),
    "MeanAbsoluteError": (("mean_absolute_error", "mae"), "regression", {}),
    "Huber": (("huber", "huber_loss"), "regression", {"delta": 1.0}),
    # engine.loss_fns: value and gradient of each, Keras' epsilons
    "Poisson": (("poisson",), "regression", {}),
    "LogCosh": (("log_cosh", "logcosh"), "regression", {}),
    "KLDivergence": (("kl_divergence", "kld", "kullback_leibler_divergence"), "regression", {}),
    "MeanSquaredLogarithmicError": (("mean_squared_logarithmic_error", "msle"), "regression", {}),
    "MeanAbsolutePercentageError": (("mean_absolute_percentage_error", "mape"), "regression", {}),
    "Hinge": (("hinge",), "regression", {}),
    "SquaredHinge": (("squared_hinge",), "regression", {}),
    "CategoricalHinge": (("categorical_hinge",), "regression", {}),
    "CosineSimilarity": (("cosine_similarity",), "regression", {"axis": -1}),
}
SUPPORTED = tuple(_ENTRIES)
#: config keys every Keras loss has that change no number ringtrain computes
_BOOKKEEPING = ("name", "dtype")
REDUCTIONS = ("sum_over_batch_size", "auto", None)


def _snake(name: str) -> str:
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


_ALIASES = {a: cls for cls, (aliases, _, _) in _ENTRIES.items() for a in aliases}


@dataclass(frozen=True)
class LossSpec:
    """A validated loss: its Keras class name and arguments (``from_logits`` as compiled;
    ``folded``: the activation the loss reads through, folded away from the model)."""

    name: str = "SparseCategoricalCrossentropy"
    args: dict = field(default_factory=dict)
    folded: str | None = None

    @property
    def kind(self) -> str:
        """``sparse``, ``categorical``, ``binary`` or ``regression``."""
        return _ENTRIES[self.name][1]

    def arg(self, key: str):
        return self.args.get(key, _ENTRIES[self.name][2].get(key))

    @property
    def metric(self) -> str:
        """What the evaluators report beside the loss."""
        return "mae" if self.kind == "regression" else "accuracy"

    def describe(self) -> str:
        """``CategoricalCrossentropy(from_logits=False, label_smoothing=0.1)`` for the log."""
        args = {k: self.arg(k) for k in _ENTRIES[self.name][2] if k != "axis"}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in args.items())})"

    def keras(self) -> dict:
        """The Keras serialization (``compile_config.loss``)."""
        cfg = {"name": _ENTRIES[self.name][0][0], "reduction": "sum_over_batch_size"}
        cfg.update({k: self.arg(k) for k in _ENTRIES[self.name][2]})
        return {"module": "keras.losses", "class_name": self.name, "config": cfg,
                "registered_name": None}  # fmt: skip

    def record(self) -> dict:
        """What ``/status`` and the checkpoint keep: the Keras serialization and the summary."""
        return {"keras": self.keras(), "describe": self.describe()}


#: what runs without compile settings (the presets): sparse cross-entropy from logits
DEFAULT = LossSpec("SparseCategoricalCrossentropy", {"from_logits": True})


def parse(doc) -> LossSpec | None:
    """``compile_config.loss`` (a string alias, a class name, ``{"class_name", "config"}``, or
    a loss function as Keras serializes one) → :class:`LossSpec`; None where there is none.
    Unsupported values raise naming the field."""
    if doc is None:
        return None
    if isinstance(doc, str):
        cls = _ALIASES.get(doc) or _ALIASES.get(_snake(doc)) or (doc if doc in _ENTRIES else None)
        if cls is None:
            raise InvalidSpec(
                f"model: {WHERE}={doc!r} is not supported (supported: {', '.join(SUPPORTED)} "
                "or their snake_case names)"
            )
        return LossSpec(cls)
    if not isinstance(doc, dict):
        raise InvalidSpec(f"model: {WHERE}={doc!r} is not supported (one loss, by name or class)")
    if doc.get("class_name") == "function" and isinstance(doc.get("config"), str):
        return parse(doc["config"])  # compile(loss=keras.losses.mean_squared_error)
    cls = doc.get("class_name")
    if cls not in _ENTRIES:
        cls = _ALIASES.get(str(cls))
    if cls is None:
        raise InvalidSpec(
            f"model: {WHERE}.class_name={doc.get('class_name')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    known = _ENTRIES[cls][2]
    args = {}
    for k, v in (doc.get("config") or {}).items():
        at = f"model: {WHERE}.config.{k}={v!r}"
        if k in _BOOKKEEPING:
            continue
        if k == "reduction":
            if v not in REDUCTIONS:
                raise InvalidSpec(f"{at} is not supported (supported: 'sum_over_batch_size')")
        elif k not in known:
            raise InvalidSpec(f"model: {WHERE}.config.{k}: {cls} argument not supported")
        elif k == "axis":
            if v not in (-1, None):
                raise InvalidSpec(f"{at} is not supported (supported: -1)")
        elif k == "from_logits":
            args[k] = bool(v)
        elif k == "ignore_class":
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise InvalidSpec(f"{at} is not supported (supported: None or a class id)")
            args[k] = v
        elif k == "label_smoothing":
            if not isinstance(v, int | float) or not 0 <= v <= 1:
                raise InvalidSpec(f"{at} is not supported (supported: 0 to 1)")
            args[k] = float(v)
        elif k == "delta":
            if not isinstance(v, int | float) or v <= 0:
                raise InvalidSpec(f"{at} is not supported (supported: a positive number)")
            args[k] = float(v)
    return LossSpec(cls, args)


def fold(spec: LossSpec, last_activation: str | None) -> LossSpec:
    """The activation folded into the loss (``softmax`` / ``sigmoid``), or a refusal where a
    probability loss would read something that is not one."""
    need = {"sparse": "softmax", "categorical": "softmax", "binary": "sigmoid"}.get(spec.kind)
    if need is None:
        return spec
    if last_activation == need:
        return LossSpec(spec.name, spec.args, need)
    other = "sigmoid" if need == "softmax" else "softmax"
    if last_activation == other:
        # Keras' TensorFlow backend would read the other activation's input as its logits
        raise InvalidSpec(
            f"model: {WHERE} {spec.name} on a model whose last layer is a {other}: Keras "
            f"computes it from the {other}'s input, not its output (supported: a {need} "
            "ending, or a linear one with from_logits=True)"
        )
    if not spec.arg("from_logits"):
        raise InvalidSpec(
            f"model: {WHERE} {spec.name} with from_logits=False needs a model whose last layer "
            f"is a {need} (supported: a {need} ending, or from_logits=True)"
        )
    return spec


def label_buffer(spec: LossSpec, batch: int, k: int, dtype=np.float32) -> np.ndarray:
    """One batch of labels as the loss reads them: class ids, or rows like the output."""
    if spec.kind == "sparse":
        return np.zeros(batch, np.int64)
    return np.zeros((batch, k), dtype)


def buffer_bytes(spec: LossSpec, batch: int, k: int, itemsize: int = 4) -> tuple[int, int]:
    """(labels, workspace) bytes a :class:`Loss` allocates: what the memory plan counts."""
    labels = batch * 8 if spec.kind == "sparse" else batch * k * itemsize
    work = (2 * batch * k + 2 * batch) * itemsize  # grad, work, rowtmp, picked
    if spec.kind == "sparse" and spec.arg("ignore_class") is not None:
        work += batch * 9  # valid (bool), safe (int64)
    if spec.kind != "sparse" and spec.arg("label_smoothing"):
        work += batch * k * itemsize  # the smoothed labels
    if spec.name in loss_fns.FNS:
        work += loss_fns.nbytes(batch, k, itemsize)
    return labels, work


class Loss:
    """One program's loss: ``labels`` and ``grad`` (dloss/doutput) allocated once.

    ``step(z)`` is the training path: the mean loss of the batch in ``labels``, the gradient
    written into ``grad`` (already divided by the batch size). ``total`` / ``score`` are the
    evaluation path on any number of rows (float64): the summed loss and the summed metric
    (correct predictions, or absolute error) of those rows."""

    def __init__(self, spec: LossSpec, batch: int, k: int, dtype=np.float32):
        self.spec, self.batch, self.k = spec, batch, k
        self.dtype = np.dtype(dtype)
        self.labels = label_buffer(spec, batch, k, self.dtype)
        self.grad = np.zeros((batch, k), self.dtype)
        self.work = np.zeros((batch, k), self.dtype)
        self.rowtmp = np.zeros((batch, 1), self.dtype)
        self.picked = np.zeros(batch, self.dtype)
        self.arange = np.arange(batch)
        self.ignore = spec.arg("ignore_class") if spec.kind == "sparse" else None
        if self.ignore is not None:
            self.valid = np.zeros(batch, np.bool_)
            self.safe = np.zeros(batch, np.int64)
        ls = spec.arg("label_smoothing") or 0.0
        self.smooth = (1.0 - ls, ls / k if spec.kind == "categorical" else 0.5 * ls)
        self.delta = spec.arg("delta")
        self.smoothed = np.zeros_like(self.grad) if self.smooth[1] else None
        self.inv = self.dtype.type(1.0 / batch)
        self.inv_k = self.dtype.type(1.0 / (batch * k))
        self.fn = loss_fns.FNS.get(spec.name)
        self.fn_work = loss_fns.Work(batch, k, self.dtype) if self.fn else None

    # -- training: preallocated, nothing allocated per step ---------------------------------
    def step(self, z: np.ndarray) -> float:
        kind, name = self.spec.kind, self.spec.name
        if kind == "sparse":
            return self._sparse(z)
        if kind == "categorical":
            return self._categorical(z)
        if kind == "binary":
            return self._binary(z)
        if self.fn is not None:
            loss = self.fn(z, self.labels, self.grad, self.fn_work)
            np.multiply(self.grad, self.inv, out=self.grad)
            return loss / self.batch
        return self._elementwise(z, name)

    def _sparse(self, z: np.ndarray) -> float:
        p, tmp, picked, labels = self.work, self.rowtmp, self.picked, self.labels
        if self.ignore is not None:
            np.not_equal(labels, self.ignore, out=self.valid)
            np.multiply(labels, self.valid, out=self.safe)
            labels = self.safe
        np.max(z, axis=1, keepdims=True, out=tmp)
        np.subtract(z, tmp, out=p)
        np.copyto(picked, p[self.arange, labels])
        np.exp(p, out=p)
        np.sum(p, axis=1, keepdims=True, out=tmp)
        np.divide(p, tmp, out=p)
        np.log(tmp, out=tmp)
        d = self.grad
        np.copyto(d, p)
        d[self.arange, labels] -= 1
        if self.ignore is not None:
            # Keras masks the ignored rows and divides by the rows that count (none: 0)
            np.subtract(tmp[:, 0], picked, out=picked)
            np.multiply(picked, self.valid, out=picked)
            np.multiply(d, self.valid[:, None], out=d)
            count = int(np.count_nonzero(self.valid))
            np.multiply(d, self.dtype.type(1.0 / max(count, 1)), out=d)
            return float(picked.sum()) / count if count else 0.0
        else:
            loss = (float(tmp.sum()) - float(picked.sum())) / self.batch
        np.multiply(d, self.inv, out=d)
        return loss

    def _smoothed(self) -> np.ndarray:
        """The labels, or the smoothed labels in ``smoothed``."""
        if self.smoothed is None:
            return self.labels
        y = self.smoothed
        np.multiply(self.labels, self.dtype.type(self.smooth[0]), out=y)
        np.add(y, self.dtype.type(self.smooth[1]), out=y)
        return y

    def _categorical(self, z: np.ndarray) -> float:
        p, tmp, d = self.work, self.rowtmp, self.grad
        y = self._smoothed()
        np.max(z, axis=1, keepdims=True, out=tmp)
        np.subtract(z, tmp, out=p)  # z - max
        np.multiply(y, p, out=d)
        picked = float(d.sum())
        np.exp(p, out=p)
        np.sum(p, axis=1, keepdims=True, out=tmp)
        np.divide(p, tmp, out=p)
        np.log(tmp, out=tmp)  # lse - max
        np.multiply(tmp, y, out=d)
        loss = (float(d.sum()) - picked) / self.batch
        np.subtract(p, y, out=d)
        np.multiply(d, self.inv, out=d)
        return loss

    def _binary(self, z: np.ndarray) -> float:
        y, w, d = self._smoothed(), self.work, self.grad
        # max(z, 0) - z*y + log1p(exp(-|z|)), as tf.nn.sigmoid_cross_entropy_with_logits
        np.abs(z, out=w)
        np.negative(w, out=w)
        np.exp(w, out=w)
        np.log1p(w, out=w)
        np.multiply(z, y, out=d)
        np.subtract(w, d, out=w)
        np.maximum(z, 0, out=d)
        np.add(w, d, out=w)
        loss = float(w.sum()) / (self.batch * self.k)
        # sigmoid(z) - y
        np.negative(z, out=d)
        np.exp(d, out=d)
        np.add(d, 1, out=d)
        np.reciprocal(d, out=d)
        np.subtract(d, y, out=d)
        np.multiply(d, self.inv_k, out=d)
        return loss

    def _elementwise(self, z: np.ndarray, name: str) -> float:
        e, d = self.work, self.grad
        np.subtract(z, self.labels, out=e)
        if name == "MeanSquaredError":
            np.multiply(e, e, out=d)
            loss = float(d.sum())
            np.multiply(e, self.dtype.type(2.0) * self.inv_k, out=d)
        elif name == "MeanAbsoluteError":
            np.abs(e, out=d)
            loss = float(d.sum())
            np.sign(e, out=d)
            np.multiply(d, self.inv_k, out=d)
        else:  # Huber
            delta = self.dtype.type(self.delta)
            np.clip(e, -delta, delta, out=d)  # the gradient, before scaling
            # 0.5 c^2 + delta (|e| - |c|) with c = clip(e): both of Keras' branches at once
            loss = float(np.dot(d.ravel(), d.ravel())) * 0.5
            np.abs(e, out=e)
            outside = float(e.sum())
            np.abs(d, out=e)
            loss += float(self.delta) * (outside - float(e.sum()))
            np.multiply(d, self.inv_k, out=d)
        return loss / (self.batch * self.k)

    # -- evaluation: whole rows, float64 -----------------------------------------------------
    def total(self, z: np.ndarray, y: np.ndarray) -> float:
        """The summed per-example loss of the rows of ``z`` (the program's output) and ``y``."""
        z = np.asarray(z, np.float64)
        kind, name = self.spec.kind, self.spec.name
        if kind == "sparse":
            y = np.asarray(y, np.int64)
            valid = np.ones(len(y), bool) if self.ignore is None else y != self.ignore
            y = np.where(valid, y, 0)
            m = z.max(axis=1)
            lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
            return float(np.sum((lse - z[np.arange(len(y)), y]) * valid))
        y = np.asarray(y, np.float64) * self.smooth[0] + self.smooth[1]
        if self.fn is not None:
            y = y.reshape(z.shape)
            return self.fn(z, y, np.empty_like(z), loss_fns.Work(len(z), z.shape[1], np.float64))
        if kind == "categorical":
            m = z.max(axis=1, keepdims=True)
            lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))
            return float(np.sum(y * (lse - z)))
        if kind == "binary":
            per = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
            return float(per.mean(axis=1).sum())
        e = z - y
        if name == "MeanSquaredError":
            per = e * e
        elif name == "MeanAbsoluteError":
            per = np.abs(e)
        else:
            a = np.abs(e)
            per = np.where(a <= self.delta, 0.5 * e * e, self.delta * a - 0.5 * self.delta**2)
        return float(per.mean(axis=1).sum())

    def score(self, z: np.ndarray, y: np.ndarray) -> float:
        """The summed metric of the rows: correct predictions (Keras' ``accuracy`` for this
        loss: sparse/categorical argmax, binary at 0.5, a row's mean over its outputs), or for
        regression the absolute error (each row's mean over its outputs)."""
        kind = self.spec.kind
        if kind == "sparse":
            return float(np.count_nonzero(np.argmax(z, axis=1) == y))
        if kind == "categorical":
            return float(np.count_nonzero(np.argmax(z, axis=1) == np.argmax(y, axis=1)))
        if kind == "binary":
            # Keras thresholds the model's output at 0.5: sigmoid(z) > 0.5 is z > 0 when folded
            pred = z > (0.0 if self.spec.folded else 0.5)
            return float(np.sum(np.mean(pred == (np.asarray(y) > 0.5), axis=1)))
        return float(np.sum(np.mean(np.abs(np.asarray(z, np.float64) - y), axis=1)))
