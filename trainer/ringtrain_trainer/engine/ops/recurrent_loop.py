"""The loop shared by Keras' ``LSTM``, ``GRU`` and ``SimpleRNN`` ops (``_Recurrent``): one op per
layer that runs the whole sequence, forward and backpropagation through time, on buffers
planned at compile time.

Layout: every per-timestep tensor is kept batch-major, ``(b, T, ·)``, so the input projection
for all timesteps is one matmul on the ``(b·T, d)`` view before the loop, the weight gradients
are one matmul each after it (``x.T @ dz``, ``h_prev.T @ dz``), and a ``return_sequences``
output is contiguous for the next op. A timestep's slice ``[:, t]`` is strided by whole rows,
which BLAS takes as is. ``h_prev`` (``(b, T, u)``: the state each step read, zeros first) is
kept separately from the output so the recurrent kernel's gradient is one product too.

The recurrent kernel used by backward is the one forward read (``ws["U"]``): backward through
time runs in ``backward_local``, before either half, and nothing updates a node's weights
before its own backward has streamed them.

Gate order and weights are Keras': kernel ``(d, G·u)``, recurrent kernel ``(u, G·u)``; LSTM
gates i, f, c, o with bias ``(4u,)``; GRU gates z, r, h with bias ``(2, 3u)`` (input bias, then
recurrent bias, which is added before the reset gate multiplies it).

Masks (``masked=True``; ``engine.ops.mask``): the op reads ``(x, mask)``, the mask
``(b, T)`` in timestep order, and runs Keras' masked loop (``backend.rnn``): a masked step
keeps the previous state (``h``, and ``c`` for an LSTM) and returns the previous output, or
zeros with ``zero_output_for_mask`` (what ``Bidirectional`` sets when it returns sequences).
Backward splits each step's state gradient into the part through the new state (``× m``) and
the part carried past the step (``× (1 - m)``).

``recurrent_dropout`` (training only) runs as Keras 3's cells run it (``implementation=1``,
forced by the argument): every example draws, once per sequence, a mask over the state per
gate (four for LSTM, three for GRU, one for SimpleRNN) that scales the state the gate's
recurrent matmul reads, the same at every step; an LSTM's or GRU's ``dropout`` then also draws
an input mask per gate, which the op applies itself (``_project``). The masks are drawn as
``dropout.masks`` draws Dropout's; the masked states and inputs (``hm``, ``xm``, gate-major
so a gate's block is one contiguous matrix) are kept for the weight gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops.dense import product_rows
from ringtrain_trainer.engine.ops.dropout import masks
from ringtrain_trainer.engine.tensor import ParamSpec

#: the draw key of an RNN's recurrent masks, apart from its input masks (layer index + this)
REC_MASK_KEY = 1 << 21

#: the activations an RNN cell may use: element-wise ones whose derivative comes from the output
ACTIVATIONS = ("tanh", "sigmoid", "relu", "linear")


class _Recurrent(Op):
    """What LSTM and GRU share: shapes, parameters, the input projection, weight gradients."""

    kind = "recurrent"
    gates = 0
    #: the LSTM's and GRU's fast path (``recurrent_fast``) instead of this per-step loop
    fast = False

    def forward(self, ws: dict[str, Any], x, mask=None, *, kernel, recurrent_kernel, bias=None):
        """The cell's pass over the sequence: each cell's own (SimpleRNN, LSTM, GRU)."""
        raise NotImplementedError

    def __init__(
        self,
        in_shape,
        units: int,
        activation: str = "tanh",
        recurrent_activation: str = "sigmoid",
        use_bias: bool = True,
        return_sequences: bool = False,
        go_backwards: bool = False,
        masked: bool = False,
        zero_output_for_mask: bool = False,
        dropout: float = 0.0,
        recurrent_dropout: float = 0.0,
        index: int = 0,
    ):
        for arg, v in (("activation", activation), ("recurrent_activation", recurrent_activation)):
            if v not in ACTIVATIONS:
                raise ValueError(f"{type(self).__name__}: {arg}={v!r} is not one of {ACTIVATIONS}")
        self.in_shape = tuple(in_shape)
        if len(self.in_shape) != 2:
            raise ValueError(f"{type(self).__name__}: input must be (timesteps, features)")
        self.T, self.d = self.in_shape
        self.u, self.act, self.rec_act = units, activation, recurrent_activation
        self.use_bias, self.return_sequences = use_bias, return_sequences
        self.out_shape = (self.T, units) if return_sequences else (units,)
        #: the timestep each step reads (reversed for ``go_backwards``); per-timestep buffers
        #: are indexed by timestep, the output by step, as Keras returns it
        self.order = list(range(self.T))[:: -1 if go_backwards else 1]
        self.go_backwards = go_backwards
        self.masked, self.zero_output = masked, masked and zero_output_for_mask
        #: the inputs it reads: the sequence, and its mask when ``masked``
        self.n_inputs = 2 if masked else 1
        self.in_shapes = [self.in_shape, (self.T,)][: self.n_inputs]
        #: with ``recurrent_dropout``: masks per gate block (``K`` of them, ``w`` columns each);
        #: the input's (``idrop``) here only then, else a SharedDropout node before the op
        self.rdrop, self.index = float(recurrent_dropout), index
        self.K = self.gates if self.gates > 1 else 1
        self.idrop = float(dropout) if self.rdrop and self.gates > 1 else 0.0

    def _bias_shape(self) -> tuple[int, ...]:
        return (self.gates * self.u,)

    def params(self, layer):
        d, u, g = self.d, self.u, self.gates * self.u
        ps = [
            ParamSpec(layer, "kernel", (d, g), d, g, True),
            ParamSpec(layer, "recurrent_kernel", (u, g), u, g, True),
        ]
        if self.use_bias:
            ps.append(ParamSpec(layer, "bias", self._bias_shape(), 0, 0, False))
        return ps

    def buffers(self, b, train, need_dx):
        T, u, g = self.T, self.u, self.gates * self.u
        bufs = {
            "out": ((b, *self.out_shape), "f"),
            "gates": ((b, T, g), "f"),
            "h_prev": ((b, T, u), "f"),
            "h": ((b, u), "f"),
            "tmp": ((b, u), "f"),
        }
        if train:
            bufs.update({"dz": ((b, T, g), "f"), "dh": ((b, u), "f"), "tmp2": ((b, u), "f")})
            bufs.update({"ones": ((b * T,), "f")})
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
            if self.masked:
                bufs.update({"carry_h": ((b, u), "f"), "carry_c": ((b, u), "f")})
        if train and self.rdrop:
            k, d = self.K, self.d
            bufs.update({"rmask": ((b, k, u), "f"), "hm": ((k, b, T, u), "f")})
            bufs["drh"] = ((b, u), "f")
            if self.idrop:
                bufs.update({"imask": ((b, k, d), "f"), "xm": ((k, b, T, d), "f")})
                if need_dx:
                    bufs["dxk"] = ((b, T, d), "f")
        if self.masked:
            bufs.update({"m": ((b, T, 1), "f"), "inv": ((b, T, 1), "f")})
            bufs["h_new"] = ((b, u), "f")
        return bufs

    def flops(self, b, train, need_dx):
        g = self.gates * self.u
        fwd = 2 * b * self.T * (self.d + self.u) * g
        return fwd * (1 + (1 + need_dx if train else 0)) + (fwd if train else 0) // 2

    def bind(self, ws: dict[str, Any], b):
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["h_prev"][:, self.order[0]] = 0
        if "hm" in ws:
            ws["hm"][:, :, self.order[0]] = 0

    def _block(self, k):
        w = self.gates * self.u // self.K
        return slice(k * w, (k + 1) * w)

    def _draw(self, ws: dict[str, Any]):
        """This batch's dropout masks (training with ``recurrent_dropout`` only)."""
        if "rmask" not in ws:
            return
        c = ws["ctx"]
        key = (c["seed"], self.index + REC_MASK_KEY, c["step"], c["example0"])
        masks(*key, self.rdrop, ws["rmask"])
        if "imask" in ws:
            masks(c["seed"], self.index, c["step"], c["example0"], self.idrop, ws["imask"])

    def _rec(self, ws: dict[str, Any], t, U, out):
        """``out (b, G·u)``: step ``t``'s recurrent projection of the state it reads, each gate
        block's through its recurrent dropout mask in training."""
        h = ws["h_prev"][:, t]
        if "rmask" not in ws:
            np.matmul(h, U, out=out)
            return
        for k in range(self.K):
            hm, blk = ws["hm"][k][:, t], self._block(k)
            np.multiply(h, ws["rmask"][:, k], out=hm)
            np.matmul(hm, U[:, blk], out=out[:, blk])

    def _rec_back(self, ws: dict[str, Any], dzt, dh):
        """``dh``: the read state's gradient from the recurrent projection's ``dzt``."""
        U = ws["U"]
        if "rmask" not in ws:
            np.matmul(dzt, U.T, out=dh)
            return
        dh.fill(0)
        for k in range(self.K):
            blk, tmp = self._block(k), ws["drh"]
            np.matmul(dzt[:, blk], U[:, blk].T, out=tmp)
            np.multiply(tmp, ws["rmask"][:, k], out=tmp)
            np.add(dh, tmp, out=dh)

    def _take_mask(self, ws: dict[str, Any], mask):
        """The step masks ``m`` and ``1 - m`` as ``(b, T, 1)`` columns, once per batch."""
        if self.masked:
            np.copyto(ws["m"][..., 0], mask)
            np.subtract(1, ws["m"], out=ws["inv"])

    def _blend(self, ws: dict[str, Any], t, new, prev):
        """A masked step keeps the previous state: ``new = prev + m (new - prev)`` in place;
        ``prev`` None: the zero initial state."""
        m = ws["m"][:, t]
        if prev is None:
            np.multiply(new, m, out=new)
        else:
            np.subtract(new, prev, out=new)
            np.multiply(new, m, out=new)
            np.add(new, prev, out=new)

    def _emit(self, ws: dict[str, Any], s):
        """Step ``s``'s state in ``ws["h"]`` → the output and the next step's ``h_prev``."""
        h, t = ws["h"], self.order[s]
        if self.masked:
            if self.zero_output:
                np.multiply(h, ws["m"][:, t], out=ws["h_new"])
            self._blend(ws, t, h, ws["h_prev"][:, t] if s else None)
        y = ws["h_new"] if self.zero_output else h
        if s + 1 < self.T:
            np.copyto(ws["h_prev"][:, self.order[s + 1]], h)
        if self.return_sequences:
            np.copyto(ws["out"][:, s], y)
        elif s + 1 == self.T:
            np.copyto(ws["out"], y)

    def _dh_from_output(self, ws: dict[str, Any], dout, s):
        """Add the output's gradient at step ``s`` to the running state gradient ``dh``; when
        masked, keep the part carried past a masked step in ``carry_h`` (added back by
        :meth:`_dh_carry`) and leave in ``dh`` the gradient of the step's new state."""
        dh = ws["dh"]
        if self.return_sequences:  # a folded Flatten hands it over as (b, T·u)
            dout = dout.reshape(dout.shape[0], self.T, -1)
        d = dout[:, s] if self.return_sequences else dout if s + 1 == self.T else None
        if d is not None and not self.zero_output:
            np.add(dh, d.reshape(dh.shape), out=dh)
        if not self.masked:
            return
        t = self.order[s]
        np.multiply(dh, ws["inv"][:, t], out=ws["carry_h"])
        np.multiply(dh, ws["m"][:, t], out=dh)
        if d is not None and self.zero_output:
            np.multiply(d.reshape(dh.shape), ws["m"][:, t], out=ws["h_new"])
            np.add(dh, ws["h_new"], out=dh)

    def _dh_carry(self, ws: dict[str, Any], s):
        """After step ``s``'s backward wrote the previous state's gradient into ``dh``."""
        if self.masked and s:
            np.add(ws["dh"], ws["carry_h"], out=ws["dh"])

    def backward_inputs(self, dx):
        return (dx, None) if self.masked else dx

    def _dz_x(self, ws: dict[str, Any]):
        """The gradient of the input projection's output, ``(b·T, G·u)``."""
        return ws["dz"].reshape(-1, self.gates * self.u)

    def _dz_h(self, ws: dict[str, Any]):
        """The gradient of the recurrent projection's output, ``(b·T, G·u)``."""
        return ws["dz"].reshape(-1, self.gates * self.u)

    def backward_input(self, ws: dict[str, Any], dout, *, kernel, recurrent_kernel, bias=None):
        dx = ws["dx"]
        if "imask" not in ws:
            np.matmul(self._dz_x(ws), kernel.T, out=dx.reshape(-1, self.d))
            return self.backward_inputs(dx)
        dx.fill(0)
        dxk = ws["dxk"]
        for k in range(self.K):
            blk = self._block(k)
            np.matmul(self._dz_x(ws)[:, blk], kernel[:, blk].T, out=dxk.reshape(-1, self.d))
            np.multiply(dxk, ws["imask"][:, k, None], out=dxk)
            np.add(dx, dxk, out=dx)
        return self.backward_inputs(dx)

    def _masked_product(self, ws: dict[str, Any], key, dz, grad, rows):
        """Rows ``rows`` of a kernel's gradient when gate block ``k`` read ``ws[key][k]``."""
        lo, hi = rows
        for k in range(self.K):
            a, blk = ws[key][k].reshape(-1, grad.shape[0]), self._block(k)
            np.matmul(a[:, lo:hi].T, dz[:, blk], out=grad[lo:hi, blk])

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name == "kernel" and "xm" in ws:
            self._masked_product(ws, "xm", self._dz_x(ws), grad, rows)
        elif name == "recurrent_kernel" and "hm" in ws:
            self._masked_product(ws, "hm", self._dz_h(ws), grad, rows)
        elif name == "kernel":
            product_rows(ws["x"], self._dz_x(ws), grad, rows)
        elif name == "recurrent_kernel":
            h_prev = ws["h_prev"].reshape(-1, self.u)
            product_rows(h_prev, self._dz_h(ws), grad, rows)
        else:
            ones = ws["ones"].reshape(-1, 1)
            product_rows(ones, self._dz_x(ws), grad, rows)

    def _project(self, ws: dict[str, Any], x, kernel, bias, into):
        """``into (b, T, G·u) = x @ kernel + bias`` for every timestep at once."""
        self._draw(ws)
        ws["x"] = x2 = x.reshape(-1, self.d)
        i2 = into.reshape(x2.shape[0], -1)
        if "imask" in ws:
            for k in range(self.K):
                xm, blk = ws["xm"][k], self._block(k)
                np.multiply(x.reshape(xm.shape), ws["imask"][:, k, None], out=xm)
                np.matmul(xm.reshape(-1, self.d), kernel[:, blk], out=i2[:, blk])
        else:
            np.matmul(x2, kernel, out=i2)
        if bias is not None:
            np.add(i2, bias, out=i2)
