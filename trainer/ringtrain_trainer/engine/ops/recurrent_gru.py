"""Keras 3's ``GRU`` cell (``reset_after=True``) on the shared BPTT loop (``recurrent_loop``)."""

from __future__ import annotations

import numpy as np

from ringtrain_trainer.engine.ops.recurrent_loop import _Recurrent
from ringtrain_trainer.layers.base import act_backward, act_forward


def _candidate_and_blend(act: str, hh: np.ndarray, h_prev, z, h: np.ndarray) -> None:
    """Both GRU forms' step end, in place: the candidate ``hh = act(hh)``, then
    ``h = z * h_prev + (1 - z) * hh`` written as ``(h_prev - hh) * z + hh``."""
    act_forward(act, hh)
    np.subtract(h_prev, hh, out=h)
    np.multiply(h, z, out=h)
    np.add(h, hh, out=h)


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
            self._rec_back(ws, drt, tmp)
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

    def forward(self, ws, x, mask=None, *, kernel, recurrent_kernel, bias=None):
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

    def backward_local(self, ws, dout):
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

    def backward_weights(self, ws, dout, name, grad, rows):
        if name != "recurrent_kernel":
            return super().backward_weights(ws, dout, name, grad, rows)
        (lo, hi), u, dz = rows, self.u, self._dz_h(ws)
        for src, blk in ((ws["h_prev"], slice(0, 2 * u)), (ws["rh"], slice(2 * u, 3 * u))):
            a = src.reshape(-1, u)
            np.matmul(a[:, lo:hi].T, dz[:, blk], out=grad[lo:hi, blk])
