"""Keras' ``LSTM`` cell on the shared BPTT loop (``recurrent_loop``), with its fast path for
Keras' default activations (``recurrent_fast``): every gate from one ``tanh`` per timestep
(``sigmoid(x) = tanh(x / 2) / 2 + 1 / 2``, the x / 2 folded into ``WaT``'s rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.activations import act_backward, act_forward
from ringtrain_trainer.engine.ops.recurrent_fast import _FastCell


class LSTM(_FastCell):
    """``z = x W + h U + b``; ``i, f, o = σ(·)``, ``c̃ = act(·)``; ``c = f c + i c̃``;
    ``h = o act(c)``."""

    gates = 4
    #: fast path: ``E``'s blocks are the gradients of i, f, c̃, o (pre-activations), then
    #: ``dh · o · tanh'(c)`` (the cell state's part from this step's output) and the next
    #: output's gradient, which ``Ua`` adds as it is
    fast_identities = (5,)

    @property
    def fast_cols(self):
        return 4 * self.u, 6 * self.u

    def buffers(self, b, train, need_dx):
        T, u = self.T, self.u
        if not self.fast:
            bufs = super().buffers(b, train, need_dx)
            bufs.update({"c": ((b, T, u), "f"), "act_c": ((b, T, u), "f")})
            bufs["rec"] = ((b, 4 * u), "f")
            return bufs
        bufs = self.fast_buffers(b, train, need_dx)
        bufs.update({"gates": ((T, 4 * u, b), "f"), "c": ((T, u, b), "f")})
        bufs.update({"act_c": ((T, u, b), "f"), "tmp": ((u, b), "f")})
        bufs["scale"] = ((2, 4 * u, 1), "f")
        if train:  # E's factors: of dc (i, f, c~ rows) and of dh (o, the cell's part)
            bufs.update({"Mc": ((T, 3 * u, b), "f"), "Mh": ((T, 2 * u, b), "f")})
            bufs.update({"dc": ((u, b), "f"), "dcf": ((u, b), "f")})
        return bufs

    def bind(self, ws: dict[str, Any], b):
        super().bind(ws, b)
        if not self.fast:
            return
        u, sc, g, c, ac = self.u, ws["scale"], ws["gates"], ws["c"], ws["act_c"]
        sc[:] = 0.5  # y = sc[0] * tanh + sc[1]; the candidate's rows are tanh itself
        sc[0, 2 * u : 3 * u], sc[1, 2 * u : 3 * u] = 1, 0
        order = self.order
        ws["gsteps"] = [
            (
                a,
                g[t],
                g[t, :u],
                g[t, u : 2 * u],
                g[t, 2 * u : 3 * u],
                g[t, 3 * u :],
                c[t],
                c[order[s - 1]] if s else None,
                ac[t],
                h_out,
            )
            for s, (t, a, h_out) in enumerate(ws["steps"])
        ]
        if "E" in ws:
            E, Mc, Mh, DH = ws["E"], ws["Mc"], ws["Mh"], ws["DH"]
            ws["bsteps"] = [
                (
                    DH[t, None],
                    Mh[t].reshape(2, u, b),
                    E[t, 3 * u : 5 * u].reshape(2, u, b),
                    E[t, 4 * u : 5 * u],
                    Mc[t].reshape(3, u, b),
                    E[t, : 3 * u].reshape(3, u, b),
                    g[t, u : 2 * u],
                    E[t],
                    DH[order[s - 1]] if s else None,
                )
                for s, t in enumerate(order)
            ]

    def forward(self, ws: dict[str, Any], x, mask=None, *, kernel, recurrent_kernel, bias=None):
        if self.fast:
            return self._forward_fast(ws, x, kernel, recurrent_kernel, bias)
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

    def backward_local(self, ws: dict[str, Any], dout):
        if self.fast:
            return self._backward_fast(ws, dout)
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

    def _forward_fast(self, ws: dict[str, Any], x, kernel, U, bias):
        d, u, WaT, sc, tmp = self.d, self.u, ws["WaT"], ws["scale"], ws["tmp"]
        ws["U"] = U
        self.fast_input(ws, x)
        np.copyto(WaT[:, :d], kernel.T)
        np.copyto(WaT[:, d : d + u], U.T)
        if bias is not None:
            np.copyto(WaT[:, -1], bias)
        np.multiply(WaT, sc[0], out=WaT)  # the sigmoid gates' x / 2, exactly
        for a, g, i, f, cc, o, ct, c_prev, act_c, h in ws["gsteps"]:
            np.matmul(WaT, a, out=g)
            np.tanh(g, out=g)
            np.multiply(g, sc[0], out=g)
            np.add(g, sc[1], out=g)
            np.multiply(i, cc, out=ct)
            if c_prev is not None:
                np.multiply(f, c_prev, out=tmp)
                np.add(ct, tmp, out=ct)
            np.tanh(ct, out=act_c)
            np.multiply(o, act_c, out=h)
        return self.fast_out(ws)

    def _backward_fast(self, ws: dict[str, Any], dout):
        u, g, c, act_c, E = self.u, ws["gates"], ws["c"], ws["act_c"], ws["E"]
        Mc, Mh = ws["Mc"], ws["Mh"]
        # every timestep's factors at once, the local derivatives first (in E, free until the
        # loop): σ' = (1 - y) y for i, f, o; 1 - c~² for the candidate
        der = E[:, : 4 * u]
        np.subtract(1.0, g, out=der)
        np.multiply(der, g, out=der)
        cand, dcand = g[:, 2 * u : 3 * u], der[:, 2 * u : 3 * u]
        np.multiply(cand, cand, out=dcand)
        np.subtract(1.0, dcand, out=dcand)
        # dz_i = dc c~ σ'(i), dz_f = dc c_prev σ'(f), dz_c~ = dc i (1 - c~²)
        np.multiply(cand, der[:, :u], out=Mc[:, :u])
        mf, order = Mc[:, u : 2 * u], self.order
        mf[order[0]] = 0  # no previous cell state
        if self.go_backwards:  # the step after timestep t reads timestep t + 1's state
            np.multiply(c[1:], der[:-1, u : 2 * u], out=mf[:-1])
        else:
            np.multiply(c[:-1], der[1:, u : 2 * u], out=mf[1:])
        np.multiply(g[:, :u], dcand, out=Mc[:, 2 * u :])
        # dz_o = dh tanh(c) σ'(o); the cell state's gradient from h: dh o (1 - tanh(c)²)
        np.multiply(act_c, der[:, 3 * u :], out=Mh[:, :u])
        np.multiply(act_c, act_c, out=Mh[:, u:])
        np.subtract(1.0, Mh[:, u:], out=Mh[:, u:])
        np.multiply(g[:, 3 * u :], Mh[:, u:], out=Mh[:, u:])
        np.copyto(ws["UaT"][:, : 4 * u], ws["U"])  # UaT[:, 4u:5u] stays 0: no state reads it
        self.fast_dout(ws, dout, 5)
        dc, dcf, UaT = ws["dc"], ws["dcf"], ws["UaT"]
        carry = False
        for dh, mh, eh, from_h, mc, ec, f, e, dh_prev in reversed(ws["bsteps"]):
            np.multiply(dh, mh, out=eh)
            if carry:  # the cell state's gradient: this step's part + the next step's
                np.add(from_h, dcf, out=dc)
                dct = dc
            else:
                dct = from_h
            np.multiply(dct[None], mc, out=ec)
            if dh_prev is not None:
                np.matmul(UaT, e, out=dh_prev)
                np.multiply(dct, f, out=dcf)
                carry = True
        self.fast_grads(ws, slice(0, 4 * u))
