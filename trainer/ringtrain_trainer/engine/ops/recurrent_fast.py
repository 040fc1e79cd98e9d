"""The fast path of Keras' ``LSTM`` and ``GRU`` (:class:`_FastCell`): Keras' default activations
(tanh, sigmoid), no mask, no ``recurrent_dropout`` — what ``recurrent_loop``'s per-step loop
runs otherwise, with the same arithmetic up to rounding.

Why (issue 24, py-spy and timeit at batch 32, 8 units): a timestep is numpy call overhead,
and a call on a ``[:, t]`` slice of a batch-major ``(b, T, ·)`` buffer is strided, which costs
numpy's iterator 3–5× the call on a contiguous block (≈ 3 µs against ≈ 0.6–1.2 µs). So the
fast path keeps its per-step buffers *time- and unit-major*, ``(T, ·, b)``: a timestep is a
contiguous ``(·, b)`` block and each gate's rows in it are a contiguous ``(u, b)`` block.

- ``xh`` ``(T, d + u + 1, b)``: each timestep's input, the state its step reads and a row of
  1s, so a step's whole pre-activation is one product ``WaT @ xh[t]`` with ``WaT`` (kernel,
  recurrent kernel and biases stacked, transposed, once per forward; the sigmoid gates' rows
  halved, exactly, so ``sigmoid(x) = tanh(x / 2) / 2 + 1 / 2`` needs no scaling pass). A step
  writes its new state straight into the rows the next step reads.
- Backward forms every timestep's local derivatives at once (``M``); a step is then one
  broadcast product of its state gradient with them into ``E[t]`` (the pre-activation
  gradients, the state's carried term, the next output's gradient) and one product
  ``UaT @ E[t]`` (the recurrent kernel beside identities), the previous step's state gradient.
- Every weight gradient comes from one batched product ``xh[t] @ E[t].T`` summed over ``t``
  (``dWa``: kernel, recurrent kernel and bias rows at once), the input gradient from one
  batched product with the kernel; the pieces then copy rows of ``dWa``.

Rounding differs from the per-step loop (biases summed inside the product, a gradient's
factors multiplied in another order): ≤ 1e-15 in float64 (tests/trainer/test_ops_rnn_fast.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.ops.recurrent_loop import _Recurrent


class _FastCell(_Recurrent):
    """An LSTM or GRU cell with the fast path; the cell supplies ``fast_cols`` (``WaT``'s rows,
    ``E``'s rows), ``fast_identities`` (``E``'s blocks added to the previous state's gradient
    as they are) and its own forward and backward steps."""

    fast_identities: tuple[int, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = (self.act, self.rec_act) == ("tanh", "sigmoid")
        self.fast = self.fast and not self.masked and not self.rdrop

    @property
    def fast_cols(self) -> tuple[int, int]:
        raise NotImplementedError

    def fast_buffers(self, b, train, need_dx) -> dict:
        """The fast path's buffers in place of the per-step loop's."""
        T, u, D = self.T, self.u, self.d + self.u + 1
        wa, e = self.fast_cols
        bufs = {
            "out": ((b, *self.out_shape), "f"),
            "xh": ((T, D, b), "f"),
            "hT": ((u, b), "f"),
            "WaT": ((wa, D), "f"),
        }
        if train:
            bufs.update({"E": ((T, e, b), "f"), "DH": ((T, u, b), "f"), "UaT": ((u, e), "f")})
            bufs.update({"wtmp": ((T, D, wa), "f"), "dWa": ((D, wa), "f")})
            if need_dx:
                bufs.update({"dx": ((b, *self.in_shape), "f"), "dxT": ((T, self.d, b), "f")})
        return bufs

    def bind(self, ws: dict[str, Any], b):
        if not self.fast:
            return super().bind(ws, b)
        d, u, T, xh = self.d, self.u, self.T, ws["xh"]
        xh[:, -1] = 1
        order = self.order
        #: per step: (timestep, the xh block it reads, where it writes its new state)
        ws["steps"] = [
            (t, xh[t], xh[order[s + 1], d : d + u] if s + 1 < T else ws["hT"])
            for s, t in enumerate(order)
        ]
        if "UaT" in ws:
            eye = np.eye(u, dtype=ws["UaT"].dtype)
            for blk in self.fast_identities:
                ws["UaT"][:, blk * u : (blk + 1) * u] = eye
        return None

    def fast_input(self, ws: dict[str, Any], x):
        np.copyto(ws["xh"][:, : self.d], x.reshape(x.shape[0], self.T, self.d).transpose(1, 2, 0))

    def fast_out(self, ws: dict[str, Any]):
        """The output from the states the steps wrote (``xh``'s state rows, ``hT``)."""
        out, d, u = ws["out"], self.d, self.u
        if not self.return_sequences:
            np.copyto(out, ws["hT"].T)
            return out
        states = ws["xh"][:, d : d + u]  # step s wrote the rows timestep order[s + 1] reads
        states = states[-2::-1] if self.go_backwards else states[1:]
        np.copyto(out[:, : self.T - 1], states.transpose(2, 0, 1))
        np.copyto(out[:, -1], ws["hT"].T)
        return out

    def fast_dout(self, ws: dict[str, Any], dout, blk):
        """Before the backward loop: the last step's state gradient into ``DH``, and with
        ``return_sequences`` every earlier step's output gradient into ``E``'s block ``blk``
        (the step after it adds it through ``UaT``'s identity)."""
        u, T, order, DH = self.u, self.T, self.order, ws["DH"]
        if not self.return_sequences:
            np.copyto(DH[order[-1]], dout.reshape(dout.shape[0], u).T)
            return
        dout = dout.reshape(dout.shape[0], T, u)  # by step; E by timestep
        np.copyto(DH[order[-1]], dout[:, -1].T)
        into = ws["E"][:, blk * u : (blk + 1) * u]
        if self.go_backwards:  # step s ≥ 1 is timestep T - 1 - s and reads dout[:, s - 1]
            np.copyto(into[: T - 1], dout[:, -2::-1].transpose(1, 2, 0))
        else:
            np.copyto(into[1:], dout[:, :-1].transpose(1, 2, 0))

    def fast_grads(self, ws: dict[str, Any], e_rows):
        """``dWa = Σ_t xh[t] @ E[t, e_rows].T``: every weight gradient at once."""
        np.matmul(ws["xh"], ws["E"][:, e_rows].transpose(0, 2, 1), out=ws["wtmp"])
        np.sum(ws["wtmp"], axis=0, out=ws["dWa"])

    def backward_input(self, ws: dict[str, Any], dout, *, kernel, recurrent_kernel, bias=None):
        if not self.fast:
            return super().backward_input(
                ws, dout, kernel=kernel, recurrent_kernel=recurrent_kernel, bias=bias
            )
        g = self.gates * self.u  # E's first G·u rows: the input projection's gradient
        np.matmul(kernel, ws["E"][:, :g], out=ws["dxT"])
        np.copyto(ws["dx"], ws["dxT"].transpose(2, 0, 1))
        return self.backward_inputs(ws["dx"])

    def fast_weight_rows(self, ws: dict[str, Any], name):
        """``name``'s gradient as ``dWa``'s rows (columns in the parameter's order)."""
        d, u, dWa = self.d, self.u, ws["dWa"]
        return {"kernel": dWa[:d], "recurrent_kernel": dWa[d : d + u], "bias": dWa[-1:]}[name]

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if not self.fast:
            return super().backward_weights(ws, dout, name, grad, rows)
        lo, hi = rows
        g = grad.reshape(-1, grad.shape[-1])
        np.copyto(g[lo:hi], self.fast_weight_rows(ws, name)[lo:hi])
        return None
