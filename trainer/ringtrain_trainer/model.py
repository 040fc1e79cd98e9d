"""The seeds' CNNs with explicit forward and backward passes in numpy (im2col + BLAS).

Pipeline position: :class:`ModelSpec` describes the layers and the *parameter layout*; the
emulated IPU (``trainer.ipu``) compiles a :class:`Program` — every activation and workspace
buffer for one batch size, allocated once — and runs it every step.

Parameter layout: all parameters live in one flat buffer in **reverse layer order** (last layer
first, bias before kernel), as PyTorch DDP orders its buckets. Backward produces gradients in
that order, so every group of finished gradients is a contiguous slice of the flat gradient
buffer that the reducer can hand to the allreduce without copying.

The layers themselves live in ``layers/``: the fused fast path (``layers.fused``: ConvPool,
Dense) and the general Keras layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import InvalidSpec

MODELS = ("cnn", "cnn2")
#: weight gradients larger than this (elements) are computed and streamed in row blocks; the
#: reducer's buckets are cut on the same grid (``ModelSpec.param_pieces``)
GRAD_BLOCK_ELEMS = 1 << 16


@dataclass(frozen=True)
class ParamSpec:
    """One trainable tensor: its layer, shape, and Keras' fan-in/fan-out for Glorot init."""

    layer: int
    name: str
    shape: tuple[int, ...]
    fan_in: int
    fan_out: int
    glorot: bool
    #: initialised to ones (BatchNormalization's gamma) rather than Glorot or zeros
    ones: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    """Where a parameter sits in the flat buffer."""

    spec: ParamSpec
    start: int
    stop: int


class ModelSpec:
    """Layers plus the flat parameter layout (reverse layer order, bias before kernel)."""

    def __init__(self, name: str, layers: list, input_shape=(28, 28, 1), num_classes: int = 10):
        self.name, self.layers = name, layers
        self.input_shape, self.num_classes = input_shape, num_classes
        slots: list[Slot] = []
        offset = 0
        for li in reversed(range(len(layers))):
            for p in reversed(layers[li].params(li)):
                slots.append(Slot(p, offset, offset + p.size))
                offset += p.size
        self.slots = slots
        self.num_params = offset
        #: per layer: (start, stop) of its contiguous slice of the flat buffer
        self.layer_ranges = []
        for li in range(len(layers)):
            mine = [s for s in slots if s.spec.layer == li]
            self.layer_ranges.append(
                (min(s.start for s in mine), max(s.stop for s in mine))
                if mine
                else (offset, offset)
            )
            offset = self.layer_ranges[-1][0]
        at = {(s.spec.layer, s.spec.name): s.start for s in slots}
        #: the gradient pieces backward streams, in order, as (start, stop) of the flat buffer:
        #: last layer first; within a layer as its ``grad_plan`` says
        self.grad_pieces = [
            (at[li, name] + lo, at[li, name] + hi)
            for li in reversed(range(len(layers)))
            for name, lo, hi in layers[li].grad_plan()
        ]
        #: the same pieces as sizes, grouped by parameter in arrival order: what the reducer
        #: plans its buckets from, so a bucket always ends where a streamed piece ends
        self.param_pieces: list[list[int]] = []
        for li in reversed(range(len(layers))):
            names: dict[str, list[int]] = {}
            for name, lo, hi in layers[li].grad_plan():
                names.setdefault(name, []).append(hi - lo)
            self.param_pieces += names.values()
        #: non-trainable state (BatchNormalization's moving statistics): per layer
        #: (name, size, initial value), laid out in forward layer order; never reduced
        self.state_specs = [getattr(layer, "state_specs", list)() for layer in layers]
        self.state_size = sum(n for specs in self.state_specs for _, n, _ in specs)

    def views(self, flat: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Per layer, name → view into ``flat`` shaped like the parameter."""
        out: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        for s in self.slots:
            out[s.spec.layer][s.spec.name] = flat[s.start : s.stop].reshape(s.spec.shape)
        return out

    def init_state(self, dtype=np.float32) -> np.ndarray:
        return np.concatenate(
            [np.full(n, v, dtype) for specs in self.state_specs for _, n, v in specs]
            or [np.zeros(0, dtype)]
        )

    def state_views(self, state: np.ndarray) -> list[dict[str, np.ndarray]]:
        out, at = [], 0
        for specs in self.state_specs:
            out.append({})
            for name, n, _ in specs:
                out[-1][name], at = state[at : at + n], at + n
        return out

    def init(self, seed: int, dtype=np.float32) -> np.ndarray:
        """Keras defaults: Glorot-uniform kernels, zero biases, drawn in forward layer order."""
        flat = np.zeros(self.num_params, dtype)
        rng = np.random.Generator(np.random.PCG64(seed))
        for s in sorted(self.slots, key=lambda s: (s.spec.layer, s.spec.name != "kernel")):
            if s.spec.glorot:
                limit = math.sqrt(6.0 / (s.spec.fan_in + s.spec.fan_out))
                flat[s.start : s.stop] = rng.uniform(-limit, limit, s.spec.size)
            elif s.spec.ones:
                flat[s.start : s.stop] = 1
        return flat

    def flops_per_example(self, train: bool = True) -> int:
        return sum(layer.flops(1, train, i > 0) for i, layer in enumerate(self.layers))


def build(name: str) -> ModelSpec:
    """A preset name, a ``.json`` file of ``model.to_json()`` or a ``.keras`` file
    (``keras_model.load``); the presets are Keras configs shipped with the package."""
    from ringtrain_trainer import keras_model

    return keras_model.load(name)


def build_handwritten(name: str) -> ModelSpec:
    """``cnn``: the seeds' CNN; ``cnn2``: the TensorFlow tutorial's two-conv variant."""
    from ringtrain_trainer.layers.fused import ConvPool, Dense

    if name == "cnn":
        c1 = ConvPool((28, 28, 1), 32)
        flat = math.prod(c1.out_shape)
        return ModelSpec(name, [c1, Dense(flat, 64, True), Dense(64, 10, False)])
    if name == "cnn2":
        c1 = ConvPool((28, 28, 1), 32)
        c2 = ConvPool(c1.out_shape, 64)
        flat = math.prod(c2.out_shape)
        return ModelSpec(name, [c1, c2, Dense(flat, 64, True), Dense(64, 10, False)])
    raise InvalidSpec(f"--model: unknown model {name!r} (known: {', '.join(MODELS)})")


class Program:
    """One compiled (model, batch size, train/eval) program: every buffer allocated up front.

    ``forward`` / ``backward_pieces`` allocate nothing; ``backward_pieces`` yields each gradient piece
    of ``spec.grad_pieces`` right after it is written (last layer first), which is how the IPU
    streams gradients out while backward continues.
    """

    def __init__(
        self,
        spec: ModelSpec,
        batch: int,
        train: bool,
        dtype=np.float32,
        grads_first: bool = False,
        state: np.ndarray | None = None,
    ):
        self.spec, self.batch, self.train, self.dtype = spec, batch, train, np.dtype(dtype)
        #: set by the IPU before each run: what Dropout's masks depend on (``layers``)
        self.ctx = {"seed": 0, "step": 0, "example0": 0}
        #: this program's copy of the model's non-trainable state (``ModelSpec.state_specs``)
        self.state = spec.init_state(self.dtype) if state is None else state
        state_views = spec.state_views(self.state)
        #: stream each layer's weight gradients before its input gradient (``backward_iter``)
        self.grads_first = grads_first
        self.ws: list[dict] = []
        for i, layer in enumerate(spec.layers):
            bufs = layer.buffers(batch, train, need_dx=i > 0)
            ws = {
                k: np.zeros(shape, self.dtype if t == "f" else np.bool_)
                for k, (shape, t) in bufs.items()
            }
            ws.update(state_views[i], ctx=self.ctx)
            layer.bind(ws, batch)
            self.ws.append(ws)
        self.x = np.zeros((batch, *spec.input_shape), self.dtype)
        self.labels = np.zeros(batch, np.int64)
        k = spec.num_classes
        self.probs = np.zeros((batch, k), self.dtype)
        self.dlogits = np.zeros((batch, k), self.dtype)
        self.rowtmp = np.zeros((batch, 1), self.dtype)
        self.picked = np.zeros(batch, self.dtype)
        self.arange = np.arange(batch)

    @staticmethod
    def buffer_bytes(spec: ModelSpec, batch: int, train: bool, itemsize: int = 4) -> dict[str, int]:
        """Bytes of activations and workspace this program allocates (the IPU's memory plan)."""
        acts = work = 0
        for i, layer in enumerate(spec.layers):
            for key, (shape, t) in layer.buffers(batch, train, need_dx=i > 0).items():
                n = math.prod(shape) * (itemsize if t == "f" else 1)
                if key in ("out", "pooled", "conv"):
                    acts += n
                else:
                    work += n
        k = spec.num_classes
        data = batch * math.prod(spec.input_shape) * itemsize + batch * 8
        work += (2 * batch * k + 2 * batch) * itemsize
        return {"activations": acts, "workspace": work, "data": data}

    def forward(
        self, params: list[dict[str, np.ndarray]], on_layer: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Logits; ``on_layer(i)`` (a tracer's lap) after each layer ``i``."""
        h = self.x
        for i, (layer, ws, p) in enumerate(zip(self.spec.layers, self.ws, params)):
            h = layer.forward(ws, h, **p)
            if on_layer is not None:
                on_layer(i)
        return h

    def loss_and_dlogits(self, logits: np.ndarray) -> float:
        """Softmax cross-entropy from logits, mean over the local batch; writes dloss/dlogits."""
        p, tmp, picked = self.probs, self.rowtmp, self.picked
        np.max(logits, axis=1, keepdims=True, out=tmp)
        np.subtract(logits, tmp, out=p)
        np.copyto(picked, p[self.arange, self.labels])
        np.exp(p, out=p)
        np.sum(p, axis=1, keepdims=True, out=tmp)
        np.divide(p, tmp, out=p)
        np.log(tmp, out=tmp)
        loss = (float(tmp.sum()) - float(picked.sum())) / self.batch
        d = self.dlogits
        np.copyto(d, p)
        d[self.arange, self.labels] -= 1
        np.multiply(d, self.dtype.type(1.0 / self.batch), out=d)
        return loss

    def backward_pieces(
        self,
        params: list[dict[str, np.ndarray]],
        grads: list[dict[str, np.ndarray]],
        on_layer: Callable[[int], None] | None = None,
    ):
        """Generator: backward (last layer first), yielding each ``(start, stop)`` of
        ``spec.grad_pieces`` once those gradients are written, so replicas and shards can run
        in lock step piece by piece."""
        g = self.dlogits
        pieces = iter(self.spec.grad_pieces)
        for i in reversed(range(len(self.spec.layers))):
            layer, ws = self.spec.layers[i], self.ws[i]
            args = {**params[i], **{"d" + k: v for k, v in grads[i].items()}}
            steps = layer.backward_iter(ws, g, grads_first=self.grads_first, **args)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    g = done.value
                    if on_layer is not None:
                        on_layer(i)
                    break
                yield next(pieces)
