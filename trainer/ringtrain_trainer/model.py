"""The seeds' CNNs with explicit forward and backward passes in numpy (im2col + BLAS).

Pipeline position: :class:`ModelSpec` describes the layers and the *parameter layout*; the
emulated IPU (``trainer.ipu``) compiles a :class:`Program` — every activation and workspace
buffer for one batch size, allocated once — and runs it every step.

Parameter layout: all parameters live in one flat buffer in **reverse layer order** (last layer
first, bias before kernel), as PyTorch DDP orders its buckets. Backward produces gradients in
that order, so every group of finished gradients is a contiguous slice of the flat gradient
buffer that the reducer can hand to the allreduce without copying.

Speed: a conv layer is always followed by a 2x2 max-pool, so :class:`ConvPool` builds its
im2col matrix in *pool-window-major* order (the four positions of each pooling window are four
contiguous blocks). Pooling is then three contiguous ``np.maximum`` calls, and bias + ReLU run
after pooling on a quarter of the data (max commutes with a per-channel bias and with ReLU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

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


class ConvPool:
    """Conv2D(k x k, 'valid', no stride) → MaxPool 2x2 (floor) → + bias → ReLU, NHWC."""

    kind = "conv"

    def __init__(self, in_shape: tuple[int, int, int], filters: int, kernel: int = 3):
        h, w, c = in_shape
        self.in_shape, self.cin, self.cout, self.k = in_shape, c, filters, kernel
        self.ho, self.wo = h - kernel + 1, w - kernel + 1
        self.hp, self.wp = self.ho // 2, self.wo // 2
        if self.hp < 1 or self.wp < 1:
            raise InvalidSpec(f"input {in_shape} too small for a {kernel}x{kernel} conv + 2x2 pool")
        self.out_shape = (self.hp, self.wp, filters)
        self.kk = kernel * kernel * c
        # With one input channel a patch row is only k*k floats, too short for a fast strided
        # copy; storing im2col transposed makes every copied run a whole image row instead.
        self.transposed = c == 1

    def params(self, layer: int) -> list[ParamSpec]:
        k, c, f = self.k, self.cin, self.cout
        return [
            ParamSpec(layer, "kernel", (k, k, c, f), k * k * c, k * k * f, True),
            ParamSpec(layer, "bias", (f,), 0, 0, False),
        ]

    def buffers(self, b: int, train: bool, need_dx: bool) -> dict[str, tuple[tuple[int, ...], str]]:
        rows = 4 * b * self.hp * self.wp
        pooled = (b, self.hp, self.wp, self.cout)
        bufs = {
            "cols": ((self.kk, rows) if self.transposed else (rows, self.kk), "f"),
            "conv": ((rows, self.cout), "f"),
            "pooled": (pooled, "f"),
            "out": (pooled, "f"),
        }
        if train:
            bufs.update({"mask": (pooled, "?"), "eq": (pooled, "?"),
                         "dconv": ((rows, self.cout), "f"), "ones": ((rows,), "f")})
            if need_dx:
                bufs.update({"dcols": ((rows, self.kk), "f"), "dx": ((b,) + self.in_shape, "f")})
        return bufs

    def flops(self, b: int, train: bool, need_dx: bool) -> int:
        mm = 2 * 4 * b * self.hp * self.wp * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: dict, b: int) -> None:
        """Precompute the strided views used every step (once per compile)."""
        ws["conv4"] = ws["conv"].reshape(4, b, self.hp, self.wp, self.cout)
        if "dconv" in ws:
            ws["dconv4"] = ws["dconv"].reshape(4, b, self.hp, self.wp, self.cout)
            ws["ones"].fill(1)
        if self.transposed:
            ws["colsv"] = ws["cols"].reshape(self.k, self.k, 2, 2, b, self.hp, self.wp)
            ws["A"] = ws["cols"].T
        else:
            ws["colsv"] = ws["cols"].reshape(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin)
            ws["A"] = ws["cols"]
        if "dx" in ws:
            ws["dcols8"] = ws["dcols"].reshape(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin)

    def _windows(self, x: np.ndarray, b: int) -> np.ndarray:
        """(di, dj, b, i, j, ki, kj, c) view: input pixel (2i+di+ki, 2j+dj+kj) of image b
        (axes (ki, kj, di, dj, b, i, j) when transposed)."""
        sb, sh, sw, sc = x.strides
        if self.transposed:
            return as_strided(x, shape=(self.k, self.k, 2, 2, b, self.hp, self.wp),
                              strides=(sh, sw, sh, sw, sb, 2 * sh, 2 * sw), writeable=False)
        return as_strided(
            x,
            shape=(2, 2, b, self.hp, self.wp, self.k, self.k, self.cin),
            strides=(sh, sw, sb, 2 * sh, 2 * sw, sh, sw, sc),
            writeable=False,
        )

    def forward(self, ws: dict, x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
        if ws.get("windows_of") is not x:  # the input buffer is fixed per program: build once
            ws["windows"], ws["windows_of"] = self._windows(x, x.shape[0]), x
        np.copyto(ws["colsv"], ws["windows"])
        np.matmul(ws["A"], kernel.reshape(self.kk, self.cout), out=ws["conv"])
        c4, pooled, out = ws["conv4"], ws["pooled"], ws["out"]
        np.maximum(c4[0], c4[1], out=pooled)
        np.maximum(pooled, c4[2], out=pooled)
        np.maximum(pooled, c4[3], out=pooled)
        np.add(pooled, bias, out=out)
        np.maximum(out, 0, out=out)
        return out

    def grad_plan(self) -> list[tuple[str, int, int]]:
        """The gradient pieces backward streams, in order: ``(parameter, first, stop)`` element
        ranges of that parameter. A conv's gradients are small: bias and kernel once done."""
        return [("bias", 0, self.cout), ("kernel", 0, self.kk * self.cout)]

    def backward_iter(self, ws: dict, dout: np.ndarray, kernel: np.ndarray, dkernel: np.ndarray,
                      dbias: np.ndarray, grads_first: bool = False, **_):
        """Generator: backward, yielding each piece of :meth:`grad_plan` once it is written;
        returns the input gradient (None for the first layer). See :meth:`Dense.backward_iter`
        for ``grads_first``."""
        self._weight_grads(ws, dout, dkernel, dbias)
        if grads_first:
            yield from self.grad_plan()
        dx = self._input_grad(ws, kernel) if "dx" in ws else None
        if not grads_first:
            yield from self.grad_plan()
        return dx

    def _weight_grads(self, ws: dict, dout: np.ndarray, dkernel: np.ndarray,
                      dbias: np.ndarray) -> None:
        # Route each window's gradient to its first maximal position (TensorFlow's tie rule)
        # where the ReLU passed it; ``avail`` marks windows not yet claimed. Masks are bool,
        # so the only float passes are the four products.
        c4, d4, pooled = ws["conv4"], ws["dconv4"], ws["pooled"]
        avail, eq = ws["mask"], ws["eq"]
        d = dout.reshape(pooled.shape)
        np.greater(ws["out"], 0, out=avail)
        for k in range(3):
            np.equal(c4[k], pooled, out=eq)
            np.logical_and(eq, avail, out=eq)
            np.multiply(d, eq, out=d4[k])
            np.logical_xor(avail, eq, out=avail)
        np.multiply(d, avail, out=d4[3])
        # a column sum as a matrix-vector product: BLAS is ~10x faster than add.reduce here
        np.matmul(ws["ones"], ws["dconv"], out=dbias)
        np.matmul(ws["A"].T, ws["dconv"], out=dkernel.reshape(self.kk, self.cout))

    def _input_grad(self, ws: dict, kernel: np.ndarray) -> np.ndarray:
        np.matmul(ws["dconv"], kernel.reshape(self.kk, self.cout).T, out=ws["dcols"])
        dx, dc = ws["dx"], ws["dcols8"]
        dx.fill(0)
        h2, w2 = 2 * self.hp, 2 * self.wp
        for di in range(2):
            for dj in range(2):
                for ki in range(self.k):
                    for kj in range(self.k):
                        r, c = di + ki, dj + kj
                        view = dx[:, r:r + h2:2, c:c + w2:2, :]
                        np.add(view, dc[di, dj, :, :, :, ki, kj, :], out=view)
        return dx


class Dense:
    """x @ W + b, optionally followed by ReLU."""

    kind = "dense"

    def __init__(self, n_in: int, n_out: int, relu: bool):
        self.n_in, self.n_out, self.relu = n_in, n_out, relu
        self.out_shape = (n_out,)
        # the kernel gradient in about equal row blocks of at most GRAD_BLOCK_ELEMS elements
        blocks = -(-n_in * n_out // GRAD_BLOCK_ELEMS)
        self.block_rows = -(-n_in // blocks)

    def params(self, layer: int) -> list[ParamSpec]:
        return [
            ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True),
            ParamSpec(layer, "bias", (self.n_out,), 0, 0, False),
        ]

    def buffers(self, b: int, train: bool, need_dx: bool) -> dict[str, tuple[tuple[int, ...], str]]:
        bufs = {"out": ((b, self.n_out), "f")}
        if train:
            bufs["dz"] = ((b, self.n_out), "f")
            bufs["ones"] = ((b,), "f")
            if self.relu:
                bufs["mask"] = ((b, self.n_out), "?")
            if need_dx:
                bufs["dx"] = ((b, self.n_in), "f")
        return bufs

    def flops(self, b: int, train: bool, need_dx: bool) -> int:
        mm = 2 * b * self.n_in * self.n_out
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: dict, b: int) -> None:
        if "ones" in ws:
            ws["ones"].fill(1)

    def forward(self, ws: dict, x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
        x2 = x.reshape(x.shape[0], self.n_in)
        ws["x"] = x2
        out = ws["out"]
        np.matmul(x2, kernel, out=out)
        np.add(out, bias, out=out)
        if self.relu:
            np.maximum(out, 0, out=out)
        return out

    def grad_plan(self) -> list[tuple[str, int, int]]:
        """The gradient pieces backward streams, in order: ``(parameter, first, stop)`` element
        ranges. The bias, then the kernel in row blocks (contiguous in the flat buffer), so
        the host can reduce the first rows of a large kernel while the rest is computed."""
        n, r = self.n_out, self.block_rows
        return [("bias", 0, n)] + [("kernel", lo * n, min(lo + r, self.n_in) * n)
                                   for lo in range(0, self.n_in, r)]

    def backward_iter(self, ws: dict, dout: np.ndarray, kernel: np.ndarray, dkernel: np.ndarray,
                      dbias: np.ndarray, grads_first: bool = False, **_):
        """Generator: backward, yielding each piece of :meth:`grad_plan` once it is written;
        returns the input gradient (None for the first layer).

        By default the input gradient, which the layer below waits for, comes first (the
        critical path, as frameworks schedule it) — required when the weights are resident on
        the IPU, because the host optimizer may then update a streamed kernel block at once
        and nothing may read the kernel after it. ``grads_first`` (weights streamed in, so the
        optimizer never touches what backward reads) streams the weight gradients first, so
        the host's allreduce starts earlier and the input gradient hides part of it. Either
        way the arithmetic is the same: each block ``dW[rows] = x[:, rows]^T dz`` is the same
        dot products as the whole product."""
        dz = ws["dz"]
        if self.relu:
            np.greater(ws["out"], 0, out=ws["mask"])
            np.multiply(dout, ws["mask"], out=dz)
        else:
            np.copyto(dz, dout)
        np.matmul(ws["ones"], dz, out=dbias)
        dx = ws.get("dx")
        if dx is not None and not grads_first:
            np.matmul(dz, kernel.T, out=dx)
        pieces = self.grad_plan()
        yield pieces[0]
        xt, n = ws["x"].T, self.n_out
        for piece in pieces[1:]:
            lo, hi = piece[1] // n, piece[2] // n
            np.matmul(xt[lo:hi], dz, out=dkernel[lo:hi])
            yield piece
        if dx is not None and grads_first:
            np.matmul(dz, kernel.T, out=dx)
        return dx


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
            self.layer_ranges.append((min(s.start for s in mine), max(s.stop for s in mine))
                                     if mine else (offset, offset))
            offset = self.layer_ranges[-1][0]
        at = {(s.spec.layer, s.spec.name): s.start for s in slots}
        #: the gradient pieces backward streams, in order, as (start, stop) of the flat buffer:
        #: last layer first; within a layer as its ``grad_plan`` says
        self.grad_pieces = [(at[li, name] + lo, at[li, name] + hi)
                            for li in reversed(range(len(layers)))
                            for name, lo, hi in layers[li].grad_plan()]
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
            out[s.spec.layer][s.spec.name] = flat[s.start:s.stop].reshape(s.spec.shape)
        return out

    def init_state(self, dtype=np.float32) -> np.ndarray:
        return np.concatenate([np.full(n, v, dtype) for specs in self.state_specs
                               for _, n, v in specs] or [np.zeros(0, dtype)])

    def state_views(self, state: np.ndarray) -> list[dict[str, np.ndarray]]:
        out, at = [], 0
        for specs in self.state_specs:
            out.append({})
            for name, n, _ in specs:
                out[-1][name], at = state[at:at + n], at + n
        return out

    def init(self, seed: int, dtype=np.float32) -> np.ndarray:
        """Keras defaults: Glorot-uniform kernels, zero biases, drawn in forward layer order."""
        flat = np.zeros(self.num_params, dtype)
        rng = np.random.Generator(np.random.PCG64(seed))
        for s in sorted(self.slots, key=lambda s: (s.spec.layer, s.spec.name != "kernel")):
            if s.spec.glorot:
                limit = math.sqrt(6.0 / (s.spec.fan_in + s.spec.fan_out))
                flat[s.start:s.stop] = rng.uniform(-limit, limit, s.spec.size)
            elif s.spec.ones:
                flat[s.start:s.stop] = 1
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

    def __init__(self, spec: ModelSpec, batch: int, train: bool, dtype=np.float32,
                 grads_first: bool = False, state: np.ndarray | None = None):
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
            ws = {k: np.zeros(shape, self.dtype if t == "f" else np.bool_)
                  for k, (shape, t) in bufs.items()}
            ws.update(state_views[i], ctx=self.ctx)
            layer.bind(ws, batch)
            self.ws.append(ws)
        self.x = np.zeros((batch,) + spec.input_shape, self.dtype)
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

    def forward(self, params: list[dict[str, np.ndarray]],
                on_layer: Callable[[int], None] | None = None) -> np.ndarray:
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

    def backward_pieces(self, params: list[dict[str, np.ndarray]],
                        grads: list[dict[str, np.ndarray]],
                        on_layer: Callable[[int], None] | None = None):
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
