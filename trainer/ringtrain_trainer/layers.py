"""IPU layers for Keras models beyond the fused fast path: numpy, NHWC float32, in place.

Pipeline position: ``keras_model`` turns each validated Keras layer (``keras_config``) into one
of these — or into ``model.ConvPool`` / ``model.Dense`` where the fast path fits — and
``model.Program`` drives them all through one protocol: ``params(layer)``, ``state_specs``,
``buffers(batch, train, need_dx)``, ``flops``, ``bind(ws, batch)``, ``forward(ws, x, **params)``,
``grad_plan()`` and ``backward_iter(ws, dout, grads_first=False, **params_and_grads)``, a
generator that yields each ``grad_plan`` piece once written and returns the input gradient.
Every buffer is allocated by the Program at compile time; a training program is recognised by
its training buffers (``dz``, ``mask``, ...), so one class serves both kinds of program.

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

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ringtrain_trainer.model import ParamSpec


def act_forward(name: str, z: np.ndarray) -> None:
    """Apply an activation to ``z`` in place."""
    if name == "relu":
        np.maximum(z, 0, out=z)
    elif name == "sigmoid":
        np.negative(z, out=z)
        np.exp(z, out=z)
        np.add(z, 1, out=z)
        np.reciprocal(z, out=z)
    elif name == "tanh":
        np.tanh(z, out=z)
    elif name == "softmax":
        z2 = z.reshape(-1, z.shape[-1])
        z2 -= z2.max(axis=1, keepdims=True)
        np.exp(z2, out=z2)
        z2 /= z2.sum(axis=1, keepdims=True)


def act_backward(name: str, y: np.ndarray, dy: np.ndarray, dz: np.ndarray) -> None:
    """``dz = dy * activation'`` written into ``dz``, from the activation's output ``y``."""
    if name == "relu":
        np.multiply(dy, y > 0, out=dz)
    elif name == "sigmoid":
        np.subtract(1, y, out=dz)
        np.multiply(dz, y, out=dz)
        np.multiply(dz, dy, out=dz)
    elif name == "tanh":
        np.multiply(y, y, out=dz)
        np.subtract(1, dz, out=dz)
        np.multiply(dz, dy, out=dz)
    elif name == "softmax":
        y2, dy2 = y.reshape(-1, y.shape[-1]), dy.reshape(-1, y.shape[-1])
        s = np.einsum("ij,ij->i", y2, dy2)[:, None]
        np.subtract(dy2, s, out=dz.reshape(y2.shape))
        np.multiply(dz, y, out=dz)
    elif dz is not dy:
        np.copyto(dz, dy)


def same_pad(n: int, k: int, s: int) -> tuple[int, int, int]:
    """(output size, pad before, pad after) of TensorFlow's 'same' padding."""
    out = -(-n // s)
    total = max((out - 1) * s + k - n, 0)
    return out, total // 2, total - total // 2


class _Layer:
    """Defaults for the protocol: no parameters, no state, a whole-tensor gradient plan."""

    kind = "layer"
    name = ""
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

    def grad_plan(self) -> list[tuple[str, int, int]]:
        return [(p.name, 0, p.size) for p in reversed(self.params(0))]


class Windows(_Layer):
    """Shared geometry of Conv2D and pooling: kernel, strides, 'valid'/'same' padding."""

    def _geometry(self, in_shape, kernel, strides, padding):
        h, w, c = in_shape
        (kh, kw), (sh, sw) = kernel, strides
        if padding == "same":
            ho, pt, pb = same_pad(h, kh, sh)
            wo, pl, pr = same_pad(w, kw, sw)
        else:
            ho, wo, pt, pb, pl, pr = (h - kh) // sh + 1, (w - kw) // sw + 1, 0, 0, 0, 0
        if ho < 1 or wo < 1:
            raise ValueError(f"input {in_shape} is smaller than the {kh}x{kw} window")
        self.in_shape, self.cin, self.k, self.s = in_shape, c, (kh, kw), (sh, sw)
        self.ho, self.wo, self.pad = ho, wo, (pt, pb, pl, pr)
        self.padded = (h + pt + pb, w + pl + pr, c)

    def _win(self, xp: np.ndarray, b: int) -> np.ndarray:
        """(b, ho, wo, kh, kw, c) view of the padded input."""
        s0, s1, s2, s3 = xp.strides
        return as_strided(xp, (b, self.ho, self.wo, *self.k, self.cin),
                          (s0, s1 * self.s[0], s2 * self.s[1], s1, s2, s3), writeable=False)

    def _inner(self, xp: np.ndarray) -> np.ndarray:
        pt, pb, pl, pr = self.pad
        h, w, _ = self.in_shape
        return xp[:, pt:pt + h, pl:pl + w, :]

    def _scatter(self, dxp: np.ndarray, dwin: np.ndarray) -> None:
        """Add a (b, ho, wo, kh, kw, c) window gradient back onto the padded input gradient."""
        sh, sw = self.s
        for i in range(self.k[0]):
            for j in range(self.k[1]):
                view = dxp[:, i:i + sh * (self.ho - 1) + 1:sh, j:j + sw * (self.wo - 1) + 1:sw]
                np.add(view, dwin[:, :, :, i, j], out=view)


class Conv2D(Windows):
    """Conv2D with any kernel, strides and padding: im2col + one BLAS product."""

    kind = "conv"

    def __init__(self, in_shape, filters, kernel, strides=(1, 1), padding="valid",
                 activation="linear", use_bias=True):
        self._geometry(in_shape, kernel, strides, padding)
        self.cout, self.act, self.use_bias = filters, activation, use_bias
        self.kk = kernel[0] * kernel[1] * self.cin
        self.out_shape = (self.ho, self.wo, filters)

    def params(self, layer: int) -> list[ParamSpec]:
        (kh, kw), c, f = self.k, self.cin, self.cout
        ps = [ParamSpec(layer, "kernel", (kh, kw, c, f), kh * kw * c, kh * kw * f, True)]
        return ps + ([ParamSpec(layer, "bias", (f,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        rows = b * self.ho * self.wo
        bufs = {"cols": ((rows, self.kk), "f"), "out": ((b,) + self.out_shape, "f")}
        if any(self.pad):
            bufs["xp"] = ((b,) + self.padded, "f")
        if train:
            bufs.update({"dz": ((b,) + self.out_shape, "f"), "ones": ((rows,), "f")})
            if need_dx:
                bufs.update({"dcols": ((rows, self.kk), "f"), "dxp": ((b,) + self.padded, "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.ho * self.wo * self.kk * self.cout
        return mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["cols6"] = ws["cols"].reshape(b, self.ho, self.wo, *self.k, self.cin)
        ws["out2"] = ws["out"].reshape(-1, self.cout)
        if "dxp" in ws:
            ws["dx"] = self._inner(ws["dxp"])
            ws["dcols6"] = ws["dcols"].reshape(b, self.ho, self.wo, *self.k, self.cin)

    def forward(self, ws, x, kernel, bias=None):
        xp = ws.get("xp")
        if xp is not None:
            np.copyto(self._inner(xp), x)
        else:
            xp = x
        np.copyto(ws["cols6"], self._win(xp, x.shape[0]))
        out = ws["out2"]
        np.matmul(ws["cols"], kernel.reshape(self.kk, self.cout), out=out)
        if bias is not None:
            np.add(out, bias, out=out)
        act_forward(self.act, out)
        return ws["out"]

    def backward_iter(self, ws, dout, kernel, dkernel, bias=None, dbias=None,
                      grads_first=False):
        dz = ws["dz"]
        act_backward(self.act, ws["out"], dout.reshape(dz.shape), dz)
        dz2 = dz.reshape(-1, self.cout)
        if dbias is not None:
            np.matmul(ws["ones"], dz2, out=dbias)
        np.matmul(ws["cols"].T, dz2, out=dkernel.reshape(self.kk, self.cout))
        yield from self.grad_plan()
        if "dxp" not in ws:
            return None
        np.matmul(dz2, kernel.reshape(self.kk, self.cout).T, out=ws["dcols"])
        ws["dxp"].fill(0)
        self._scatter(ws["dxp"], ws["dcols6"])
        return ws["dx"]


class Pool2D(Windows):
    """MaxPooling2D / AveragePooling2D; 'same' averages count only the real pixels (as TF)."""

    def __init__(self, in_shape, kind, pool, strides, padding):
        self._geometry(in_shape, pool, strides, padding)
        self.kind_ = kind
        self.out_shape = (self.ho, self.wo, self.cin)

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b,) + self.out_shape, "f"), "xp": ((b,) + self.padded, "f")}
        if self.kind_ == "avg":
            bufs["count"] = (self.out_shape, "f")
        if train and need_dx:
            bufs.update({"dxp": ((b,) + self.padded, "f"), "g": ((b,) + self.out_shape, "f")})
            if self.kind_ == "max":
                bufs.update({"avail": ((b,) + self.out_shape, "?"),
                             "eq": ((b,) + self.out_shape, "?")})
        return bufs

    def flops(self, b, train, need_dx):
        return b * self.ho * self.wo * self.cin * self.k[0] * self.k[1] * (1 + train)

    def bind(self, ws, b):
        ws["xp"].fill(-np.inf if self.kind_ == "max" else 0)
        if "count" in ws:
            ones = np.zeros((1,) + self.padded, ws["count"].dtype)
            self._inner(ones)[...] = 1
            np.sum(self._win(ones, 1)[0], axis=(2, 3), out=ws["count"])
        if "dxp" in ws:
            ws["dx"] = self._inner(ws["dxp"])

    def forward(self, ws, x):
        xp = ws["xp"]
        np.copyto(self._inner(xp), x)
        win = self._win(xp, x.shape[0])
        out = ws["out"]
        if self.kind_ == "max":
            np.max(win, axis=(3, 4), out=out)
        else:
            np.sum(win, axis=(3, 4), out=out)
            np.divide(out, ws["count"], out=out)
        return out

    def backward_iter(self, ws, dout, grads_first=False):
        if "dxp" not in ws:
            return None
        yield from ()
        dxp, g = ws["dxp"], ws["g"]
        dxp.fill(0)
        b = dout.shape[0]
        dout = dout.reshape(g.shape)
        win = self._win(ws["xp"], b)
        sh, sw = self.s
        if self.kind_ == "avg":
            np.divide(dout, ws["count"], out=g)
        else:
            avail, eq = ws["avail"], ws["eq"]
            avail.fill(True)
        for i in range(self.k[0]):
            for j in range(self.k[1]):
                view = dxp[:, i:i + sh * (self.ho - 1) + 1:sh, j:j + sw * (self.wo - 1) + 1:sw]
                if self.kind_ == "max":  # the first maximal position takes it (TF's rule)
                    np.equal(win[:, :, :, i, j], ws["out"], out=eq)
                    np.logical_and(eq, avail, out=eq)
                    np.logical_xor(avail, eq, out=avail)
                    np.multiply(dout, eq, out=g)
                np.add(view, g, out=view)
        return ws["dx"]


class GlobalAvgPool2D(_Layer):
    def __init__(self, in_shape):
        self.in_shape = in_shape
        self.out_shape = (in_shape[2],)
        self.n = in_shape[0] * in_shape[1]

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b,) + self.out_shape, "f")}
        if train and need_dx:
            bufs["dx"] = ((b,) + self.in_shape, "f")
        return bufs

    def forward(self, ws, x):
        np.mean(x, axis=(1, 2), out=ws["out"])
        return ws["out"]

    def backward_iter(self, ws, dout, grads_first=False):
        yield from ()
        if "dx" not in ws:
            return None
        np.multiply(dout.reshape(-1, 1, 1, self.out_shape[0]), 1.0 / self.n, out=ws["dx"])
        return ws["dx"]


class Reshape(_Layer):
    """Flatten and Reshape: a view, no copy (NHWC is already row-major like Keras)."""

    def __init__(self, in_shape, out_shape):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def buffers(self, b, train, need_dx):
        return {}

    def forward(self, ws, x):
        if ws.get("src") is not x:  # a fixed buffer per program: the same view every step
            ws["out"], ws["src"] = x.reshape((x.shape[0],) + self.out_shape), x
        return ws["out"]

    def backward_iter(self, ws, dout, grads_first=False):
        yield from ()
        return dout.reshape((dout.shape[0],) + self.in_shape)


class Elementwise(_Layer):
    """Activation / ReLU / Softmax layers and Rescaling (``x * scale + offset``)."""

    def __init__(self, shape, act="linear", scale=1.0, offset=0.0):
        self.in_shape = self.out_shape = tuple(shape)
        self.act, self.scale, self.offset = act, scale, offset

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b,) + self.out_shape, "f")}
        if train and need_dx:
            bufs["dx"] = ((b,) + self.in_shape, "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (1 + train)

    def forward(self, ws, x):
        out = ws["out"]
        np.multiply(x, out.dtype.type(self.scale), out=out)
        if self.offset:
            np.add(out, out.dtype.type(self.offset), out=out)
        act_forward(self.act, out)
        return out

    def backward_iter(self, ws, dout, grads_first=False):
        yield from ()
        if "dx" not in ws:
            return None
        dx = ws["dx"]
        act_backward(self.act, ws["out"], dout.reshape(dx.shape), dx)
        if self.scale != 1.0:
            np.multiply(dx, dx.dtype.type(self.scale), out=dx)
        return dx


class Linear(_Layer):
    """Dense on a flat input, any supported activation, with or without bias."""

    kind = "dense"

    def __init__(self, n_in, n_out, activation="linear", use_bias=True):
        self.n_in, self.n_out, self.act, self.use_bias = n_in, n_out, activation, use_bias
        self.out_shape = (n_out,)

    def params(self, layer):
        ps = [ParamSpec(layer, "kernel", (self.n_in, self.n_out), self.n_in, self.n_out, True)]
        return ps + ([ParamSpec(layer, "bias", (self.n_out,), 0, 0, False)]
                     if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        bufs = {"out": ((b, self.n_out), "f")}
        if train:
            bufs.update({"dz": ((b, self.n_out), "f"), "ones": ((b,), "f")})
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
        out = ws["out"]
        np.matmul(x2, kernel, out=out)
        if bias is not None:
            np.add(out, bias, out=out)
        act_forward(self.act, out)
        return out

    def backward_iter(self, ws, dout, kernel, dkernel, bias=None, dbias=None,
                      grads_first=False):
        dz = ws["dz"]
        act_backward(self.act, ws["out"], dout.reshape(dz.shape), dz)
        if dbias is not None:
            np.matmul(ws["ones"], dz, out=dbias)
        np.matmul(ws["x"].T, dz, out=dkernel)
        yield from self.grad_plan()
        if "dx" not in ws:
            return None
        np.matmul(dz, kernel.T, out=ws["dx"])
        return ws["dx"]


class Dropout(_Layer):
    """Inverted dropout (``x * keep / (1 - rate)``) in training, identity in evaluation."""

    def __init__(self, shape, rate, layer_index):
        self.in_shape = self.out_shape = tuple(shape)
        self.rate, self.index = rate, layer_index
        self.per = math.prod(shape)

    def buffers(self, b, train, need_dx):
        if not train:
            return {}
        shape = (b,) + self.out_shape
        return {"out": (shape, "f"), "keep": (shape, "f"), "dx": (shape, "f")}

    def forward(self, ws, x):
        if "keep" not in ws or self.rate == 0:
            ws["out"] = x
            return x
        ctx, keep = ws["ctx"], ws["keep"]
        masks(ctx["seed"], self.index, ctx["step"], ctx["example0"], self.rate, keep)
        np.multiply(x, keep, out=ws["out"])
        return ws["out"]

    def backward_iter(self, ws, dout, grads_first=False):
        yield from ()
        if "keep" not in ws or self.rate == 0:
            return dout
        np.multiply(dout.reshape(ws["keep"].shape), ws["keep"], out=ws["dx"])
        return ws["dx"]


def masks(seed: int, layer: int, step: int, example0: int, rate: float,
          out: np.ndarray) -> None:
    """Per example ``e``: Philox keyed (seed, layer) at counter (0, 0, step, example0 + e),
    uniform float32 ≥ rate → ``1 / (1 - rate)``, else 0."""
    rows = out.reshape(out.shape[0], -1)
    scale = out.dtype.type(1.0 / (1.0 - rate))
    for e in range(rows.shape[0]):
        bits = np.random.Philox(key=[seed & (2**64 - 1), layer],
                                counter=[0, 0, step, example0 + e])
        u = np.random.Generator(bits).random(rows.shape[1], np.float32)
        np.multiply(u >= rate, scale, out=rows[e], casting="unsafe")


class BatchNorm(_Layer):
    """BatchNormalization over the last axis (see the module docstring for the statistics)."""

    batch_coupled = True

    def __init__(self, shape, momentum, epsilon, center, scale):
        self.in_shape = self.out_shape = tuple(shape)
        self.c = shape[-1]
        self.momentum, self.eps, self.center, self.scale = momentum, epsilon, center, scale

    def params(self, layer):
        ps = []
        if self.scale:
            ps.append(ParamSpec(layer, "gamma", (self.c,), 0, 0, False, ones=True))
        if self.center:
            ps.append(ParamSpec(layer, "beta", (self.c,), 0, 0, False))
        return ps

    def state_specs(self):
        return [("moving_mean", self.c, 0.0), ("moving_variance", self.c, 1.0)]

    def buffers(self, b, train, need_dx):
        shape = (b,) + self.out_shape
        bufs = {"out": (shape, "f"), "inv": ((self.c,), "f"), "mean": ((self.c,), "f")}
        if train:
            bufs.update({"xhat": (shape, "f"), "dxhat": (shape, "f"), "var": ((self.c,), "f"),
                         "s1": ((self.c,), "f"), "s2": ((self.c,), "f")})
            if need_dx:
                bufs["dx"] = (shape, "f")
        return bufs

    def flops(self, b, train, need_dx):
        return b * math.prod(self.out_shape) * (4 + 8 * train)

    def forward(self, ws, x, gamma=None, beta=None):
        out, inv, mean = ws["out"], ws["inv"], ws["mean"]
        axes = tuple(range(x.ndim - 1))
        if "xhat" in ws:
            var = ws["var"]
            np.mean(x, axis=axes, out=mean)
            np.subtract(x, mean, out=out)
            xc = ws["xhat"]
            np.multiply(out, out, out=xc)
            np.mean(xc, axis=axes, out=var)
            m = out.dtype.type(self.momentum)
            for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                mv = ws[name]
                mv *= m
                mv += (1 - m) * batch
            np.add(var, self.eps, out=inv)
        else:
            np.copyto(mean, ws["moving_mean"])
            np.subtract(x, mean, out=out)
            np.add(ws["moving_variance"], self.eps, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(out, inv, out=out)
        if "xhat" in ws:
            np.copyto(ws["xhat"], out)
        if gamma is not None:
            np.multiply(out, gamma, out=out)
        if beta is not None:
            np.add(out, beta, out=out)
        return out

    def backward_iter(self, ws, dout, gamma=None, dgamma=None, beta=None, dbeta=None,
                      grads_first=False):
        xhat, dxhat = ws["xhat"], ws["dxhat"]
        dy = dout.reshape(xhat.shape)
        axes = tuple(range(dy.ndim - 1))
        if dbeta is not None:
            np.sum(dy, axis=axes, out=dbeta)
        if dgamma is not None:
            np.multiply(dy, xhat, out=dxhat)
            np.sum(dxhat, axis=axes, out=dgamma)
        yield from self.grad_plan()
        if "dx" not in ws:
            return None
        n = dy.size // self.c
        if gamma is not None:
            np.multiply(dy, gamma, out=dxhat)
        else:
            np.copyto(dxhat, dy)
        s1, s2, dx = ws["s1"], ws["s2"], ws["dx"]
        np.sum(dxhat, axis=axes, out=s1)
        np.multiply(dxhat, xhat, out=dx)
        np.sum(dx, axis=axes, out=s2)
        # dx = inv * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        s1 /= n
        s2 /= n
        np.multiply(xhat, s2, out=dx)
        np.add(dx, s1, out=dx)
        np.subtract(dxhat, dx, out=dx)
        np.multiply(dx, ws["inv"], out=dx)
        return dx
