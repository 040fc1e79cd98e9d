"""The layer protocol's defaults and the element-wise layers (activations, Rescaling,
Reshape/Flatten, Dense, Dropout); see the package docstring."""

from __future__ import annotations

import math

import numpy as np

from ringtrain_trainer.engine.tensor import ParamSpec

_CHECKED: dict = {}  # name -> table entry: the RNN cells look one up per timestep


def _in_place(name: str):
    entry = _CHECKED.get(name)
    if entry is not None:
        return entry
    from ringtrain_trainer.engine.ops.activations import ACTIVATIONS  # it imports this module

    entry = ACTIVATIONS[name]
    if entry.needs_input or entry.scratch:
        raise ValueError(f"activation {name!r} needs planned buffers: use the table's API")
    _CHECKED[name] = entry
    return entry


def act_forward(name: str, z: np.ndarray) -> None:
    """Apply an activation of ``engine.ops.activations`` that runs in place (relu, sigmoid,
    tanh, softmax, linear, ...) to ``z``."""
    _in_place(name).forward(z, z, None)


def act_backward(name: str, y: np.ndarray, dy: np.ndarray, dz: np.ndarray) -> None:
    """``dz = dy * activation'`` written into ``dz`` (not ``dy``), from the output ``y``."""
    _in_place(name).backward(None, y, dy, dz, None)


class Layer:
    """Defaults for the protocol: no parameters, no state, no fused tail in backward."""

    kind = "layer"
    name = ""
    #: one example's input and output shapes (set by each op's constructor)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    #: batch statistics: the replica's batch must not be split across host threads
    batch_coupled = False

    def params(self, layer: int) -> list[ParamSpec]:
        return []

    def state_specs(self) -> list[tuple[str, int, float]]:
        return []

    def flops(self, b: int, train: bool, need_dx: bool) -> int:
        return 0

    def bind(self, ws: dict, b: int) -> None:
        pass

    def out_and_dx(self, b: int, train: bool, need_dx: bool) -> dict:
        """The buffers of an op that writes one output and, when trained with an input
        gradient, one input-shaped gradient: what ``buffers`` of most shape and elementwise
        ops is, or starts from."""
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def backward_local(self, ws: dict, dout: np.ndarray) -> None:
        """The gradient through the op's own fused tail (its activation, its pooling) that both
        :meth:`backward_input` and :meth:`backward_weights` read; run first, once."""

    def backward_weights(self, ws: dict, dout, name: str, grad: np.ndarray, rows) -> None:
        """Write rows ``rows = (lo, hi)`` of parameter ``name``'s gradient into ``grad`` (the
        whole parameter's gradient, rows counted on its ``(size // shape[-1], shape[-1])``
        matrix view). Only layers with parameters are asked."""
        raise NotImplementedError(f"{type(self).__name__} has no parameters")


class Reshape(Layer):
    """Flatten and Reshape: a view, no copy (NHWC is already row-major like Keras)."""

    def __init__(self, in_shape, out_shape):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def buffers(self, b, train, need_dx):
        return {}

    def forward(self, ws, x):
        if ws.get("src") is not x:  # a fixed buffer per program: the same view every step
            ws["out"], ws["src"] = x.reshape((x.shape[0], *self.out_shape)), x
        return ws["out"]

    def backward_input(self, ws, dout):
        return dout.reshape((dout.shape[0], *self.in_shape))


class Elementwise(Layer):
    """Activation / ReLU / Softmax layers and Rescaling (``x * scale + offset``)."""

    def __init__(self, shape, act="linear", scale=1.0, offset=0.0):
        self.in_shape = self.out_shape = tuple(shape)
        self.act, self.scale, self.offset = act, scale, offset

    def buffers(self, b, train, need_dx):
        return self.out_and_dx(b, train, need_dx)

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (1 + train)

    def forward(self, ws, x):
        out = ws["out"]
        np.multiply(x, out.dtype.type(self.scale), out=out)
        if self.offset:
            np.add(out, out.dtype.type(self.offset), out=out)
        act_forward(self.act, out)
        return out

    def backward_input(self, ws, dout):
        dx = ws["dx"]
        act_backward(self.act, ws["out"], dout.reshape(dx.shape), dx)
        if self.scale != 1.0:
            np.multiply(dx, dx.dtype.type(self.scale), out=dx)
        return dx


class Add(Layer):
    """Keras ``Add``: the element-wise sum of its inputs, all of one shape. Its input gradients
    are the output's gradient itself, once per input; the Program sums them into whichever
    tensor is read twice (a residual connection)."""

    def __init__(self, shape, n_inputs: int = 2):
        self.in_shape = self.out_shape = tuple(shape)
        self.n_inputs = n_inputs

    def buffers(self, b, train, need_dx):
        return {"out": ((b, *self.out_shape), "f")}

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (self.n_inputs - 1)

    def forward(self, ws, *xs):
        out = ws["out"]
        np.add(xs[0], xs[1], out=out)
        for x in xs[2:]:
            np.add(out, x, out=out)
        return out

    def backward_input(self, ws, dout):
        return (dout,) * self.n_inputs


class Linear(Layer):
    """Dense on a flat input, any activation of ``engine.ops.activations`` (the table keeps the
    pre-activation where its gradient reads it: gelu, swish, ...), with or without bias."""

    kind = "dense"

    def __init__(self, n_in, n_out, activation="linear", use_bias=True):
        from ringtrain_trainer.engine.ops.activations import resolve  # it imports this module

        self.n_in, self.n_out, self.use_bias = n_in, n_out, use_bias
        self.fn = resolve(activation)
        #: the activation's name (what the loss folding and the tests read)
        self.act = self.fn.name
        self.out_shape = (n_out,)

    def params(self, layer):
        ps = [ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True)]
        return ps + (
            [ParamSpec(layer, "bias", (self.n_out,), 0, 0, False)] if self.use_bias else []
        )

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, self.n_out), "f"), **self.fn.buffers((b, self.n_out), train)}
        if train:
            bufs["ones"] = ((b,), "f")
            if need_dx:
                bufs["dx"] = ((b, self.n_in), "f")
        return bufs

    def flops(self, b, train, need_dx):
        return 2 * b * self.n_in * self.n_out * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)

    def forward(self, ws, x, kernel, bias=None):
        ws["x"] = x2 = x.reshape(x.shape[0], self.n_in)
        z = self.fn.pre(ws)
        np.matmul(x2, kernel, out=z)
        if bias is not None:
            np.add(z, bias, out=z)
        return self.fn.run(ws)

    def backward_local(self, ws, dout):
        ws["g"] = self.fn.grad(ws, dout)

    def backward_input(self, ws, dout, kernel, bias=None):
        return np.matmul(ws["g"], kernel.T, out=ws["dx"])

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["g"], out=grad)
        else:
            lo, hi = rows
            np.matmul(ws["x"].T[lo:hi], ws["g"], out=grad[lo:hi])


class Dropout(Layer):
    """Inverted dropout (``x * keep / (1 - rate)``) in training, identity in evaluation."""

    def __init__(self, shape, rate, layer_index):
        self.in_shape = self.out_shape = tuple(shape)
        self.rate, self.index = rate, layer_index
        self.per = math.prod(shape)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b, *self.out_shape)
        return {"out": (shape, "f"), "keep": (shape, "f"), "dx": (shape, "f")}

    def forward(self, ws, x):
        if "keep" not in ws or self.rate == 0:
            ws["out"] = x
            return x
        ctx, keep = ws["ctx"], ws["keep"]
        masks(ctx["seed"], self.index, ctx["step"], ctx["example0"], self.rate, keep)
        np.multiply(x, keep, out=ws["out"])
        return ws["out"]

    def backward_input(self, ws, dout):
        if "keep" not in ws or self.rate == 0:
            return dout
        np.multiply(dout.reshape(ws["keep"].shape), ws["keep"], out=ws["dx"])
        return ws["dx"]


def masks(seed: int, layer: int, step: int, example0: int, rate: float, out: np.ndarray) -> None:
    """Per example ``e``: Philox keyed (seed, layer) at counter (0, 0, step, example0 + e),
    uniform float32 ≥ rate → ``1 / (1 - rate)``, else 0.

    ``Generator.random(n, float32)`` of a fresh Philox at that counter, for every example at
    once: one bit generator whose counter is set per example (a new Philox and Generator per
    example cost ≈ 70 µs each, 2.3 ms for 32 RNN examples), its raw 64-bit words split into
    32-bit halves low first and ``(w >> 8) · 2⁻²⁴`` as numpy's float32 draw does — the same
    values to the last bit (tests/trainer/test_dropout_masks.py)."""
    rows = out.reshape(out.shape[0], -1)
    b, n = rows.shape
    words = -(-n // 8) * 4  # a Philox block: four 64-bit words, eight float32 draws
    raw = np.empty((b, words), np.uint64)
    bits = np.random.Philox(key=[seed & (2**64 - 1), layer])
    state = bits.state
    state.update(buffer_pos=4, has_uint32=0, uinteger=0)  # a fresh generator's buffer
    for e in range(b):
        state["state"]["counter"] = np.array([0, 0, step, example0 + e], np.uint64)
        bits.state = state
        raw[e] = bits.random_raw(words)
    halves = np.empty((b, 2 * words), np.uint32)
    np.copyto(halves[:, 0::2], raw, casting="unsafe")  # the low 32 bits first
    np.right_shift(raw, np.uint64(32), out=raw)
    np.copyto(halves[:, 1::2], raw, casting="unsafe")
    np.right_shift(halves, np.uint32(8), out=halves)
    uf = halves[:, :n].astype(np.float32)
    np.multiply(uf, np.float32(1.0 / 16777216.0), out=uf)
    scale = out.dtype.type(1.0 / (1.0 - rate))
    np.multiply(uf >= rate, scale, out=rows, casting="unsafe")
