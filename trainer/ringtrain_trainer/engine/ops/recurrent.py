"""Keras' recurrent cells as engine ops: ``SimpleRNN`` here, ``LSTM`` (``recurrent_lstm``) and
``GRU`` (``recurrent_gru``), all on the BPTT loop and buffers of ``recurrent_loop``; this
module is the one place the Keras front end looks a cell up by its class name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.activations import act_backward, act_forward
from ringtrain_trainer.engine.ops.recurrent_gru import GRU, GRUResetBefore
from ringtrain_trainer.engine.ops.recurrent_loop import ACTIVATIONS, _Recurrent
from ringtrain_trainer.engine.ops.recurrent_lstm import LSTM

__all__ = ["ACTIVATIONS", "GRU", "LSTM", "GRUResetBefore", "SimpleRNN"]


class SimpleRNN(_Recurrent):
    """``h = act(x W + h U + b)``: the one-gate cell (its ``recurrent_activation`` unused)."""

    gates = 1

    def buffers(self, b, train, need_dx):
        return {**super().buffers(b, train, need_dx), "rec": ((b, self.u), "f")}

    def forward(self, ws: dict[str, Any], x, mask=None, *, kernel, recurrent_kernel, bias=None):
        gates = ws["gates"]
        ws["U"] = recurrent_kernel
        self._take_mask(ws, mask)
        self._project(ws, x, kernel, bias, gates)
        for s, t in enumerate(self.order):
            g = gates[:, t]
            if s:
                self._rec(ws, t, recurrent_kernel, ws["rec"])
                np.add(g, ws["rec"], out=g)
            act_forward(self.act, g)
            np.copyto(ws["h"], g)
            self._emit(ws, s)
        return ws["out"]

    def backward_local(self, ws: dict[str, Any], dout):
        dh, dz = ws["dh"], ws["dz"]
        dh.fill(0)
        for s in range(self.T - 1, -1, -1):
            t = self.order[s]
            self._dh_from_output(ws, dout, s)
            act_backward(self.act, ws["gates"][:, t], dh, dz[:, t])
            if s:
                self._rec_back(ws, dz[:, t], dh)
            self._dh_carry(ws, s)
