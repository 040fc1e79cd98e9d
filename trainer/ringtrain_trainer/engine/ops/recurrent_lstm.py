"""Keras' ``LSTM`` cell on the shared BPTT loop (``recurrent_loop``), with its fused
tanh fast path for Keras' default activations."""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.recurrent_loop import _Recurrent
from ringtrain_trainer.layers.base import act_backward, act_forward


class LSTM(_Recurrent):
    """``z = x W + h U + b``; ``i, f, o = σ(·)``, ``c̃ = act(·)``; ``c = f c + i c̃``;
    ``h = o act(c)``."""

    gates = 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: Keras' defaults (tanh, sigmoid): every gate from one tanh per timestep
        #: (``sigmoid(x) = tanh(x / 2) / 2 + 1 / 2``, bit for bit the table's sigmoid); a
        #: masked LSTM runs the per-step loop, which blends the carried state
        #: with ``recurrent_dropout``, whose per-gate masks the fused path has no place for
        self.fused = (self.act, self.rec_act) == ("tanh", "sigmoid") and not self.masked
        self.fused = self.fused and not self.rdrop

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
                self._rec(ws, t, recurrent_kernel, ws["rec"])
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
                self._rec_back(ws, dzt, dh)
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
