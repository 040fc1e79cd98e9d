"""Keras ``LSTM``, ``GRU`` (Keras 3's ``reset_after=True``) and ``SimpleRNN``: one op per
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
"""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.dense import product_rows
from ringtrain_trainer.engine.tensor import ParamSpec
from ringtrain_trainer.layers.base import Layer, act_backward, act_forward

#: the activations an RNN cell may use: element-wise ones whose derivative comes from the output
ACTIVATIONS = ("tanh", "sigmoid", "relu", "linear")


class _Recurrent(Layer):
    """What LSTM and GRU share: shapes, parameters, the input projection, weight gradients."""

    kind = "recurrent"
    gates = 0

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
            bufs.update({"ones": ((b * T,), "f"), "row": ((g,), "f")})
            if need_dx:
                bufs["dx"] = ((b, *self.in_shape), "f")
            if self.masked:
                bufs.update({"carry_h": ((b, u), "f"), "carry_c": ((b, u), "f")})
        if self.masked:
            bufs.update({"m": ((b, T, 1), "f"), "inv": ((b, T, 1), "f")})
            bufs["h_new"] = ((b, u), "f")
        return bufs

    def flops(self, b, train, need_dx):
        g = self.gates * self.u
        fwd = 2 * b * self.T * (self.d + self.u) * g
        return fwd * (1 + (1 + need_dx if train else 0)) + (fwd if train else 0) // 2

    def bind(self, ws, b):
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["h_prev"][:, self.order[0]] = 0

    def _take_mask(self, ws, mask):
        """The step masks ``m`` and ``1 - m`` as ``(b, T, 1)`` columns, once per batch."""
        if self.masked:
            np.copyto(ws["m"][..., 0], mask)
            np.subtract(1, ws["m"], out=ws["inv"])

    def _blend(self, ws, t, new, prev):
        """A masked step keeps the previous state: ``new = prev + m (new - prev)`` in place;
        ``prev`` None: the zero initial state."""
        m = ws["m"][:, t]
        if prev is None:
            np.multiply(new, m, out=new)
        else:
            np.subtract(new, prev, out=new)
            np.multiply(new, m, out=new)
            np.add(new, prev, out=new)

    def _emit(self, ws, s):
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

    def _dh_from_output(self, ws, dout, s):
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

    def _dh_carry(self, ws, s):
        """After step ``s``'s backward wrote the previous state's gradient into ``dh``."""
        if self.masked and s:
            np.add(ws["dh"], ws["carry_h"], out=ws["dh"])

    def backward_inputs(self, dx):
        return (dx, None) if self.masked else dx

    def _dz_x(self, ws):
        """The gradient of the input projection's output, ``(b·T, G·u)``."""
        return ws["dz"].reshape(-1, self.gates * self.u)

    def _dz_h(self, ws):
        """The gradient of the recurrent projection's output, ``(b·T, G·u)``."""
        return ws["dz"].reshape(-1, self.gates * self.u)

    def backward_input(self, ws, dout, *, kernel, recurrent_kernel, bias=None):
        dx = ws["dx"]
        np.matmul(self._dz_x(ws), kernel.T, out=dx.reshape(-1, self.d))
        return self.backward_inputs(dx)

    def backward_weights(self, ws, dout, name, grad, rows):
        if name == "kernel":
            product_rows(ws["x"], self._dz_x(ws), grad, rows, ws["row"])
        elif name == "recurrent_kernel":
            h_prev = ws["h_prev"].reshape(-1, self.u)
            product_rows(h_prev, self._dz_h(ws), grad, rows, ws["row"])
        else:
            ones = ws["ones"].reshape(-1, 1)
            product_rows(ones, self._dz_x(ws), grad, rows, ws["row"])

    def _project(self, ws, x, kernel, bias, into):
        """``into (b, T, G·u) = x @ kernel + bias`` for every timestep at once."""
        ws["x"] = x2 = x.reshape(-1, self.d)
        i2 = into.reshape(x2.shape[0], -1)
        np.matmul(x2, kernel, out=i2)
        if bias is not None:
            np.add(i2, bias, out=i2)


class SimpleRNN(_Recurrent):
    """``h = act(x W + h U + b)``: the one-gate cell (its ``recurrent_activation`` unused)."""

    gates = 1

    def buffers(self, b, train, need_dx):
        return {**super().buffers(b, train, need_dx), "rec": ((b, self.u), "f")}

    def forward(self, ws, x, mask=None, *, kernel, recurrent_kernel, bias=None):
        gates = ws["gates"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, bias, gates)
        for s, t in enumerate(self.order):
            g = gates[:, t]
            if s:
                np.matmul(ws["h_prev"][:, t], recurrent_kernel, out=ws["rec"])
                np.add(g, ws["rec"], out=g)
            act_forward(self.act, g)
            np.copyto(ws["h"], g)
            self._emit(ws, s)
        return ws["out"]

    def backward_local(self, ws, dout):
        dh, dz = ws["dh"], ws["dz"]
        dh.fill(0)
        for s in range(self.T - 1, -1, -1):
            t = self.order[s]
            self._dh_from_output(ws, dout, s)
            act_backward(self.act, ws["gates"][:, t], dh, dz[:, t])
            if s:
                np.matmul(dz[:, t], ws["U"].T, out=dh)
            self._dh_carry(ws, s)


class LSTM(_Recurrent):
    """``z = x W + h U + b``; ``i, f, o = σ(·)``, ``c̃ = act(·)``; ``c = f c + i c̃``;
    ``h = o act(c)``."""

    gates = 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: Keras' defaults (tanh, sigmoid): every gate from one tanh per timestep
        #: (``sigmoid(x) = tanh(x / 2) / 2 + 1 / 2``, bit for bit the table's sigmoid); a
        #: masked LSTM runs the per-step loop, which blends the carried state
        self.fused = (self.act, self.rec_act) == ("tanh", "sigmoid") and not self.masked

    def buffers(self, b, train, need_dx):
        bufs = super().buffers(b, train, need_dx)
        T, u = self.T, self.u
        bufs.update({"c": ((b, T, u), "f"), "act_c": ((b, T, u), "f")})
        bufs["rec"] = ((b, 4 * u), "f")
        if self.fused:
            bufs["scale"] = ((3, 4 * u), "f")
            if train:
                bufs.update({"deriv": ((b, T, 4 * u), "f"), "dact": ((b, T, u), "f")})
                bufs["mult"] = ((b, T, 3 * u), "f")
        return bufs

    def bind(self, ws, b):
        super().bind(ws, b)
        if self.fused:  # rows: the pre-tanh scale, then y = a * tanh + b
            u, sc = self.u, ws["scale"]
            sc[:] = 0.5
            sc[0, 2 * u : 3 * u], sc[1, 2 * u : 3 * u], sc[2, 2 * u : 3 * u] = 1, 1, 0

    def forward(self, ws, x, mask=None, *, kernel, recurrent_kernel, bias=None):
        if self.fused:
            return self._forward_fused(ws, x, kernel, recurrent_kernel, bias)
        u, gates, c, act_c, h, tmp = self.u, ws["gates"], ws["c"], ws["act_c"], ws["h"], ws["tmp"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, bias, gates)
        for s, t in enumerate(self.order):
            g = gates[:, t]
            if s:
                np.matmul(ws["h_prev"][:, t], recurrent_kernel, out=ws["rec"])
                np.add(g, ws["rec"], out=g)
            act_forward(self.rec_act, g[:, : 2 * u])
            act_forward(self.act, g[:, 2 * u : 3 * u])
            act_forward(self.rec_act, g[:, 3 * u :])
            i, f, cc, o = g[:, :u], g[:, u : 2 * u], g[:, 2 * u : 3 * u], g[:, 3 * u :]
            ct = c[:, t]
            np.multiply(i, cc, out=ct)
            if s:
                np.multiply(f, c[:, self.order[s - 1]], out=tmp)
                np.add(ct, tmp, out=ct)
            np.copyto(act_c[:, t], ct)
            act_forward(self.act, act_c[:, t])
            np.multiply(o, act_c[:, t], out=h)
            if self.masked:
                self._blend(ws, t, ct, c[:, self.order[s - 1]] if s else None)
            self._emit(ws, s)
        return ws["out"]

    def backward_local(self, ws, dout):
        if self.fused:
            return self._backward_fused(ws, dout)
        u, gates, c, act_c = self.u, ws["gates"], ws["c"], ws["act_c"]
        dh, dc, tmp, dz = ws["dh"], ws["h"], ws["tmp"], ws["dz"]  # forward's h: free now
        dh.fill(0)
        dc.fill(0)
        for s in range(self.T - 1, -1, -1):
            t = self.order[s]
            self._dh_from_output(ws, dout, s)
            if self.masked:  # dc: the new cell state's gradient; the rest passes the step
                np.multiply(dc, ws["inv"][:, t], out=ws["carry_c"])
                np.multiply(dc, ws["m"][:, t], out=dc)
            g, dzt = gates[:, t], dz[:, t]
            i, f, cc, o = g[:, :u], g[:, u : 2 * u], g[:, 2 * u : 3 * u], g[:, 3 * u :]
            np.multiply(dh, act_c[:, t], out=tmp)
            act_backward(self.rec_act, o, tmp, dzt[:, 3 * u :])
            np.multiply(dh, o, out=tmp)
            act_backward(self.act, act_c[:, t], tmp, ws["tmp2"])
            np.add(dc, ws["tmp2"], out=dc)
            np.multiply(dc, cc, out=tmp)
            act_backward(self.rec_act, i, tmp, dzt[:, :u])
            np.multiply(dc, i, out=tmp)
            act_backward(self.act, cc, tmp, dzt[:, 2 * u : 3 * u])
            if s:
                np.multiply(dc, c[:, self.order[s - 1]], out=tmp)
                act_backward(self.rec_act, f, tmp, dzt[:, u : 2 * u])
                np.multiply(dc, f, out=dc)
                np.matmul(dzt, ws["U"].T, out=dh)
                if self.masked:
                    np.add(dc, ws["carry_c"], out=dc)
                self._dh_carry(ws, s)
            else:
                dzt[:, u : 2 * u] = 0

    # The fused path: the same arithmetic, in the same order, as the table's activations above
    # (bit for bit), in fewer numpy calls per timestep — an LSTM of 8 units at batch 64 is
    # call-bound, not compute-bound (py-spy, issue 24).
    def _forward_fused(self, ws, x, kernel, recurrent_kernel, bias):
        u, gates, c, act_c, h, tmp = self.u, ws["gates"], ws["c"], ws["act_c"], ws["h"], ws["tmp"]
        sc, rec = ws["scale"], ws["rec"]
        ws["U"] = recurrent_kernel
        self._project(ws, x, kernel, bias, gates)
        for s, t in enumerate(self.order):
            g = gates[:, t]
            if s:
                np.matmul(ws["h_prev"][:, t], recurrent_kernel, out=rec)
                np.add(g, rec, out=g)
            np.multiply(g, sc[0], out=g)
            np.tanh(g, out=g)
            np.multiply(g, sc[1], out=g)
            np.add(g, sc[2], out=g)
            ct = c[:, t]
            np.multiply(g[:, :u], g[:, 2 * u : 3 * u], out=ct)
            if s:
                np.multiply(g[:, u : 2 * u], c[:, self.order[s - 1]], out=tmp)
                np.add(ct, tmp, out=ct)
            np.tanh(ct, out=act_c[:, t])
            np.multiply(g[:, 3 * u :], act_c[:, t], out=h)
            self._emit(ws, s)
        return ws["out"]

    def _backward_fused(self, ws, dout):
        u, gates, c, act_c = self.u, ws["gates"], ws["c"], ws["act_c"]
        o = gates[..., 3 * u :]
        dh, dc, tmp, tmp2, dz = ws["dh"], ws["h"], ws["tmp"], ws["tmp2"], ws["dz"]
        deriv, dact, mult = ws["deriv"], ws["dact"], ws["mult"]
        # every timestep's local derivatives at once: (1 - y) y for the sigmoid gates,
        # 1 - y^2 for the candidate and for tanh(c); the multipliers of dc: c~, c_prev, i
        np.subtract(1.0, gates, out=deriv)
        np.multiply(deriv, gates, out=deriv)
        cand = gates[..., 2 * u : 3 * u]
        np.multiply(cand, cand, out=deriv[..., 2 * u : 3 * u])
        np.subtract(1.0, deriv[..., 2 * u : 3 * u], out=deriv[..., 2 * u : 3 * u])
        np.multiply(act_c, act_c, out=dact)
        np.subtract(1.0, dact, out=dact)
        np.copyto(mult[..., :u], cand)
        order, f_mult = self.order, mult[..., u : 2 * u]
        f_mult[:, order[0]] = 0  # no previous cell state: f's gradient is 0
        if self.go_backwards:  # the step after timestep t reads timestep t + 1's state
            np.copyto(f_mult[:, :-1], c[:, 1:])
        else:
            np.copyto(f_mult[:, 1:], c[:, :-1])
        np.copyto(mult[..., 2 * u :], gates[..., :u])
        dh.fill(0)
        dc.fill(0)
        b = dh.shape[0]
        for s in range(self.T - 1, -1, -1):
            t = order[s]
            self._dh_from_output(ws, dout, s)
            dzt = dz[:, t]
            np.multiply(dh, o[:, t], out=tmp)
            np.multiply(dact[:, t], tmp, out=tmp2)
            np.add(dc, tmp2, out=dc)
            np.multiply(
                dc[:, None, :],
                mult[:, t].reshape(b, 3, u),
                out=dzt[:, : 3 * u].reshape(b, 3, u),
            )
            np.multiply(dh, act_c[:, t], out=dzt[:, 3 * u :])
            np.multiply(deriv[:, t], dzt, out=dzt)
            if s:
                np.multiply(dc, gates[:, t, u : 2 * u], out=dc)
                np.matmul(dzt, ws["U"].T, out=dh)


class GRU(_Recurrent):
    """Keras 3's GRU (``reset_after=True``): ``z, r = σ(x W + b_x + h U + b_h)`` on their
    slices, ``h̃ = act(x W_h + b_xh + r (h U_h + b_hh))``, ``h = z h_prev + (1 - z) h̃``."""

    gates = 3

    def _bias_shape(self):
        return (2, 3 * self.u)

    def buffers(self, b, train, need_dx):
        bufs = super().buffers(b, train, need_dx)
        bufs["xw"] = ((b, self.T, 3 * self.u), "f")  # the input projection (+ input bias)
        bufs["rec"] = ((b, self.T, 3 * self.u), "f")  # the recurrent one (+ recurrent bias)
        if train:
            bufs["drec"] = ((b, self.T, 3 * self.u), "f")
        return bufs

    def forward(self, ws, x, mask=None, *, kernel, recurrent_kernel, bias=None):
        u, gates, xw, rec, h = self.u, ws["gates"], ws["xw"], ws["rec"], ws["h"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, None if bias is None else bias[0], xw)
        for s, t in enumerate(self.order):
            g, rt = gates[:, t], rec[:, t]
            h_prev = ws["h_prev"][:, t]
            np.matmul(h_prev, recurrent_kernel, out=rt)
            if bias is not None:
                np.add(rt, bias[1], out=rt)
            np.add(xw[:, t, : 2 * u], rt[:, : 2 * u], out=g[:, : 2 * u])
            act_forward(self.rec_act, g[:, : 2 * u])
            z, r, hh = g[:, :u], g[:, u : 2 * u], g[:, 2 * u :]
            np.multiply(r, rt[:, 2 * u :], out=hh)
            np.add(hh, xw[:, t, 2 * u :], out=hh)
            act_forward(self.act, hh)
            np.subtract(h_prev, hh, out=h)
            np.multiply(h, z, out=h)
            np.add(h, hh, out=h)
            self._emit(ws, s)
        return ws["out"]

    def backward_local(self, ws, dout):
        u, gates, rec, dh, tmp = self.u, ws["gates"], ws["rec"], ws["dh"], ws["tmp"]
        dz, drec = ws["dz"], ws["drec"]
        dh.fill(0)
        for s in range(self.T - 1, -1, -1):
            t = self.order[s]
            self._dh_from_output(ws, dout, s)
            g, dzt, drt = gates[:, t], dz[:, t], drec[:, t]
            z, r, hh = g[:, :u], g[:, u : 2 * u], g[:, 2 * u :]
            np.subtract(1, z, out=tmp)
            np.multiply(tmp, dh, out=tmp)
            act_backward(self.act, hh, tmp, dzt[:, 2 * u :])
            np.multiply(dzt[:, 2 * u :], r, out=drt[:, 2 * u :])
            np.multiply(dzt[:, 2 * u :], rec[:, t, 2 * u :], out=tmp)
            act_backward(self.rec_act, r, tmp, dzt[:, u : 2 * u])
            np.subtract(ws["h_prev"][:, t], hh, out=tmp)
            np.multiply(tmp, dh, out=tmp)
            act_backward(self.rec_act, z, tmp, dzt[:, :u])
            np.copyto(drt[:, : 2 * u], dzt[:, : 2 * u])
            np.multiply(dh, z, out=dh)
            np.matmul(drt, ws["U"].T, out=tmp)
            np.add(dh, tmp, out=dh)
            self._dh_carry(ws, s)

    def _dz_h(self, ws):
        return ws["drec"].reshape(-1, 3 * self.u)

    def backward_weights(self, ws, dout, name, grad, rows):
        if name != "bias":
            return super().backward_weights(ws, dout, name, grad, rows)
        for r in range(*rows):
            src = self._dz_x(ws) if r == 0 else self._dz_h(ws)
            np.matmul(ws["ones"], src, out=grad[r])
