"""Keras 3's ``GRU`` cell (``reset_after=True``) on the shared BPTT loop (``recurrent_loop``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.activations import act_backward, act_forward
from ringtrain_trainer.engine.ops.recurrent_fast import _FastCell
from ringtrain_trainer.engine.ops.recurrent_loop import _Recurrent


def _candidate_and_blend(act: str, hh: np.ndarray, h_prev, z, h: np.ndarray) -> None:
    """Both GRU forms' step end, in place: the candidate ``hh = act(hh)``, then
    ``h = z * h_prev + (1 - z) * hh`` written as ``(h_prev - hh) * z + hh``."""
    act_forward(act, hh)
    np.subtract(h_prev, hh, out=h)
    np.multiply(h, z, out=h)
    np.add(h, hh, out=h)


class GRU(_FastCell):
    """Keras 3's GRU (``reset_after=True``): ``z, r = σ(x W + b_x + h U + b_h)`` on their
    slices, ``h̃ = act(x W_h + b_xh + r (h U_h + b_hh))``, ``h = z h_prev + (1 - z) h̃``."""

    gates = 3
    #: fast path (``recurrent_fast``): ``WaT``'s rows are z, r (halved), the candidate's
    #: input part and its recurrent part (each with its bias); ``E``'s blocks are the
    #: gradients of z, r, the candidate (each pre-activation), of the candidate's recurrent
    #: part, then ``dh · z`` and the next output's gradient, which ``Ua`` adds as they are
    fast_identities = (4, 5)

    @property
    def fast_cols(self):
        return 4 * self.u, 6 * self.u

    def _bias_shape(self):
        return (2, 3 * self.u)

    def buffers(self, b, train, need_dx):
        if self.fast:  # P: z, r, the candidate's two parts; C: the candidate; M: E's factors
            bufs = self.fast_buffers(b, train, need_dx)
            bufs.update({"P": ((self.T, 4 * self.u, b), "f"), "C": ((self.T, self.u, b), "f")})
            if train:
                bufs["M"] = ((self.T, 5 * self.u, b), "f")
            return bufs
        bufs = super().buffers(b, train, need_dx)
        bufs["xw"] = ((b, self.T, 3 * self.u), "f")  # the input projection (+ input bias)
        bufs["rec"] = ((b, self.T, 3 * self.u), "f")  # the recurrent one (+ recurrent bias)
        if train:
            bufs["drec"] = ((b, self.T, 3 * self.u), "f")
        return bufs

    def bind(self, ws: dict[str, Any], b):
        super().bind(ws, b)
        if not self.fast:
            return
        d, u, P, C = self.d, self.u, ws["P"], ws["C"]
        ws["gsteps"] = [
            (
                a,
                P[t],
                P[t, : 2 * u],
                P[t, :u],
                P[t, u : 2 * u],
                P[t, 2 * u : 3 * u],
                P[t, 3 * u :],
                C[t],
                a[d : d + u],
                h_out,
            )
            for t, a, h_out in ws["steps"]
        ]
        if "E" in ws:
            E, M, DH = ws["E"], ws["M"], ws["DH"]
            ws["bsteps"] = [
                (
                    DH[t, None],
                    M[t].reshape(5, u, b),
                    E[t, : 5 * u].reshape(5, u, b),
                    E[t],
                    DH[self.order[s - 1]] if s else None,
                )
                for s, t in enumerate(self.order)
            ]

    def forward(self, ws: dict[str, Any], x, mask=None, *, kernel, recurrent_kernel, bias=None):
        if self.fast:
            return self._forward_fast(ws, x, kernel, recurrent_kernel, bias)
        u, gates, xw, rec, h = self.u, ws["gates"], ws["xw"], ws["rec"], ws["h"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, None if bias is None else bias[0], xw)
        for s, t in enumerate(self.order):
            g, rt = gates[:, t], rec[:, t]
            h_prev = ws["h_prev"][:, t]
            self._rec(ws, t, recurrent_kernel, rt)
            if bias is not None:
                np.add(rt, bias[1], out=rt)
            np.add(xw[:, t, : 2 * u], rt[:, : 2 * u], out=g[:, : 2 * u])
            act_forward(self.rec_act, g[:, : 2 * u])
            z, r, hh = g[:, :u], g[:, u : 2 * u], g[:, 2 * u :]
            np.multiply(r, rt[:, 2 * u :], out=hh)
            np.add(hh, xw[:, t, 2 * u :], out=hh)
            _candidate_and_blend(self.act, hh, h_prev, z, h)
            self._emit(ws, s)
        return ws["out"]

    def _forward_fast(self, ws: dict[str, Any], x, kernel, U, bias):
        d, u, WaT = self.d, self.u, ws["WaT"]
        ws["U"] = U
        self.fast_input(ws, x)
        np.copyto(WaT[: 3 * u, :d], kernel.T)  # WaT[3u:, :d] and WaT[2u:3u, d:-1] stay 0
        np.copyto(WaT[: 2 * u, d:-1], U[:, : 2 * u].T)
        np.copyto(WaT[3 * u :, d:-1], U[:, 2 * u :].T)
        if bias is not None:
            np.add(bias[0, : 2 * u], bias[1, : 2 * u], out=WaT[: 2 * u, -1])
            np.copyto(WaT[2 * u : 3 * u, -1], bias[0, 2 * u :])
            np.copyto(WaT[3 * u :, -1], bias[1, 2 * u :])
        np.multiply(WaT[: 2 * u], 0.5, out=WaT[: 2 * u])
        for a, p, zr, z, r, xw_h, rt_h, c, h_prev, h in ws["gsteps"]:
            np.matmul(WaT, a, out=p)
            np.tanh(zr, out=zr)  # sigmoid of the (halved) pre-activation
            np.add(zr, 1.0, out=zr)
            np.multiply(zr, 0.5, out=zr)
            np.multiply(r, rt_h, out=c)
            np.add(c, xw_h, out=c)
            np.tanh(c, out=c)
            np.subtract(h_prev, c, out=h)
            np.multiply(h, z, out=h)
            np.add(h, c, out=h)
        return self.fast_out(ws)

    def _backward_fast(self, ws: dict[str, Any], dout):
        d, u, P, C, M, U, UaT = self.d, self.u, ws["P"], ws["C"], ws["M"], ws["U"], ws["UaT"]
        z, r, zr, rt_h = P[:, :u], P[:, u : 2 * u], P[:, : 2 * u], P[:, 3 * u :]
        mz, mr, ph, mrh, mc = (M[:, k * u : (k + 1) * u] for k in range(5))
        # E's factors for every timestep: σ' of z and r, then
        # dz_h = dh (1 - z)(1 - c²) = dh ph, dz_r = dz_h rt_h σ'(r), drt_h = dz_h r,
        # dz_z = dh (h_prev - c) σ'(z), and dh z carried to the previous state
        np.subtract(1.0, zr, out=M[:, : 2 * u])
        np.multiply(M[:, : 2 * u], zr, out=M[:, : 2 * u])
        np.multiply(C, C, out=ph)
        np.subtract(1.0, ph, out=ph)
        np.subtract(1.0, z, out=mc)
        np.multiply(ph, mc, out=ph)
        np.multiply(ph, r, out=mrh)
        np.multiply(mr, rt_h, out=mr)
        np.multiply(mr, ph, out=mr)
        np.subtract(ws["xh"][:, d : d + u], C, out=mc)
        np.multiply(mz, mc, out=mz)
        np.copyto(mc, z)
        np.copyto(UaT[:, : 2 * u], U[:, : 2 * u])  # UaT[:, 2u:3u] stays 0: dz_h reaches no state
        np.copyto(UaT[:, 3 * u : 4 * u], U[:, 2 * u :])
        self.fast_dout(ws, dout, 5)
        for dh, m, e5, e, dh_prev in reversed(ws["bsteps"]):
            np.multiply(dh, m, out=e5)
            if dh_prev is not None:
                np.matmul(UaT, e, out=dh_prev)
        self.fast_grads(ws, slice(0, 4 * u))

    def backward_local(self, ws: dict[str, Any], dout):
        if self.fast:
            return self._backward_fast(ws, dout)
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
            self._rec_back(ws, drt, tmp)
            np.add(dh, tmp, out=dh)
            self._dh_carry(ws, s)

    def _dz_h(self, ws: dict[str, Any]):
        return ws["drec"].reshape(-1, 3 * self.u)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if self.fast and name != "kernel":  # dWa's columns: z, r, h (input part), h (recurrent)
            u, dWa, (lo, hi) = self.u, ws["dWa"], rows
            rec = dWa[self.d : self.d + u] if name == "recurrent_kernel" else dWa[-1:]
            g = grad.reshape(-1, 3 * u)
            for r in range(lo, hi):
                if name == "bias" and r == 0:
                    np.copyto(g[0], dWa[-1, : 3 * u])
                    continue
                src = rec[r - (name == "bias")]
                np.copyto(g[r, : 2 * u], src[: 2 * u])
                np.copyto(g[r, 2 * u :], src[3 * u :])
            return None
        if self.fast:
            np.copyto(grad[rows[0] : rows[1]], ws["dWa"][rows[0] : rows[1], : 3 * self.u])
            return None
        if name != "bias":
            return super().backward_weights(ws, dout, name, grad, rows)
        for r in range(*rows):
            src = self._dz_x(ws) if r == 0 else self._dz_h(ws)
            np.matmul(ws["ones"], src, out=grad[r])


class GRUResetBefore(_Recurrent):
    """Keras' ``GRU(reset_after=False)`` (the original GRU, ONNX ``linear_before_reset=0``):
    one bias ``(3u,)`` with the input projection; ``z, r = σ(x W + b + h U)`` on their slices,
    ``h̃ = act(x W_h + b_h + (r h) U_h)``, ``h = z h_prev + (1 - z) h̃``. The reset state
    ``r h`` of every step is kept (``rh``): the candidate's recurrent kernel gradient reads it."""

    gates = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rdrop:
            raise ValueError("GRU(reset_after=False): recurrent_dropout must be 0")

    def buffers(self, b, train, need_dx):
        bufs = super().buffers(b, train, need_dx)
        bufs["rh"] = ((b, self.T, self.u), "f")
        bufs["rec"] = ((b, 2 * self.u), "f")
        if train:
            bufs["drh"] = ((b, self.u), "f")
        return bufs

    def forward(self, ws: dict[str, Any], x, mask=None, *, kernel, recurrent_kernel, bias=None):
        u, gates, rec, h = self.u, ws["gates"], ws["rec"], ws["h"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, bias, gates)
        for s, t in enumerate(self.order):
            g, h_prev, rh = gates[:, t], ws["h_prev"][:, t], ws["rh"][:, t]
            np.matmul(h_prev, recurrent_kernel[:, : 2 * u], out=rec)
            np.add(g[:, : 2 * u], rec, out=g[:, : 2 * u])
            act_forward(self.rec_act, g[:, : 2 * u])
            z, r, hh = g[:, :u], g[:, u : 2 * u], g[:, 2 * u :]
            np.multiply(r, h_prev, out=rh)
            np.matmul(rh, recurrent_kernel[:, 2 * u :], out=rec[:, :u])
            np.add(hh, rec[:, :u], out=hh)
            _candidate_and_blend(self.act, hh, h_prev, z, h)
            self._emit(ws, s)
        return ws["out"]

    def backward_local(self, ws: dict[str, Any], dout):
        u, gates, dh, tmp, drh, dz = self.u, ws["gates"], ws["dh"], ws["tmp"], ws["drh"], ws["dz"]
        U = ws["U"]
        dh.fill(0)
        for s in range(self.T - 1, -1, -1):
            t = self.order[s]
            self._dh_from_output(ws, dout, s)
            g, dzt, h_prev = gates[:, t], dz[:, t], ws["h_prev"][:, t]
            z, r, hh = g[:, :u], g[:, u : 2 * u], g[:, 2 * u :]
            np.subtract(1, z, out=tmp)
            np.multiply(tmp, dh, out=tmp)
            act_backward(self.act, hh, tmp, dzt[:, 2 * u :])
            np.matmul(dzt[:, 2 * u :], U[:, 2 * u :].T, out=drh)
            np.multiply(drh, h_prev, out=tmp)
            act_backward(self.rec_act, r, tmp, dzt[:, u : 2 * u])
            np.subtract(h_prev, hh, out=tmp)
            np.multiply(tmp, dh, out=tmp)
            act_backward(self.rec_act, z, tmp, dzt[:, :u])
            np.multiply(dh, z, out=dh)
            np.multiply(drh, r, out=drh)
            np.add(dh, drh, out=dh)
            np.matmul(dzt[:, : 2 * u], U[:, : 2 * u].T, out=tmp)
            np.add(dh, tmp, out=dh)
            self._dh_carry(ws, s)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name != "recurrent_kernel":
            return super().backward_weights(ws, dout, name, grad, rows)
        (lo, hi), u, dz = rows, self.u, self._dz_h(ws)
        for src, blk in ((ws["h_prev"], slice(0, 2 * u)), (ws["rh"], slice(2 * u, 3 * u))):
            a = src.reshape(-1, u)
            np.matmul(a[:, lo:hi].T, dz[:, blk], out=grad[lo:hi, blk])
